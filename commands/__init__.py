"""What train.py runs beside training, on given weights: where a run's state comes from
(restore.py: the newest checkpoint, or weights given by --init-from), `train.py eval` at each
test-time setting (eval_command.py), `train.py export` (export.py), `train.py predict`
(predict.py), and the flags these commands share (weights_flags.py)."""
