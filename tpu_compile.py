"""Compile a run's training step and evaluation ACT step for a real TPU slice, on a machine
without a TPU, and print what the TPU compiler says of them: does each program compile and fit in
HBM, its FLOPs and HBM bytes per device, its collectives, where its bytes go, and the step time
those imply.

    python tpu_compile.py sudoku-mlp --slice v4-8                 # one v4-8 host, global batch 768
    python tpu_compile.py sudoku-mlp --slice v4-64 --json sudoku-v4-64.json
    python tpu_compile.py arc1 --slice v4-64 --optim.global-batch-size 1536   # any train.py flag
    python tpu_compile.py maze --slice v5e-8 --programs train_step

How, and where each figure comes from: tpu_costs/compiled_programs.py, the library behind this command.
"""
from tpu_costs.compiled_programs import command_line

if __name__ == "__main__":
    command_line()
