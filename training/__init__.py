"""The training loop's parts, which train.py puts together top to bottom: the configuration and
presets (config.py), the schedule (schedule.py), the optimizers (optim.py), the training state
and its steps (trainer.py) captured into one XLA computation each (capture.py), checkpoints
(checkpoint.py), a process's start and stop (lifecycle.py), periodic evaluation (evaluate.py,
halt_steps.py), the run's log, TensorBoard and metrics records (run_log.py, model_flops.py), each
launch's record (launch_records.py), the compile cache (compile_cache.py) and the optional W&B
mirror (wandb_mirror.py)."""
