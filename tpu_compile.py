"""Compile a run's training step and evaluation ACT step for a real TPU slice, on a machine
without a TPU, and print what the TPU compiler says of them: does each program compile and fit in
HBM, its FLOPs and HBM bytes per device, its collectives, where its bytes go, and the step time
those imply.

    python tpu_compile.py sudoku-mlp --slice v4-8                 # one v4-8 host, global batch 768
    python tpu_compile.py sudoku-mlp --slice v4-64 --json sudoku-v4-64.json
    python tpu_compile.py arc1 --slice v4-64 --optim.global-batch-size 1536   # any train.py flag
    python tpu_compile.py maze --slice v5e-8 --programs train_step

How (docs/speed.md, "Compiled for a TPU"): the run's real training step and evaluation ACT step (training/config.py,
training/trainer.py, training/capture.py, the host-ordered mesh, the split puzzle table) are traced, not run, on
a virtual CPU mesh of the slice's device count with the run's global batch; the pending program
(capture.program_hlo: every input's sharding, the donated state) goes to libtpu's compile-only
client (jax's `tpu` extra: `jax.experimental.topologies`), which compiles it for abstract
devices of the slice's topology. Nothing runs on the CPU: the training state is traced as
placeholders (shapes, no values), the batch and carries are the only buffers. The trace and each
program's compile run in processes of their own that end (compile_isolated, tpu_costs/bounded_processes.py:
`--jobs N` at once, by default as many as the memory holds), each program's line with its time
and its process's peak memory.

Sources of the figures: HBM (arguments, outputs, aliased, temporaries, code), FLOPs and bytes
accessed per device, the collectives and XLA's per-operation cycle estimates are read from the
compiled TPU program. The chips' HBM capacity, bandwidth, peak and clock are Google's published
figures (TOPOLOGIES): assumed, not measured. The step-time estimates are the compiler's figures
over those assumptions; only a TPU measures a step (the step line's MFU, `launch.sh smoke`).
Compiled results are cached (~/.cache/trm-tpu-compile, by program and topology) as each program
compiles, so a second run of the same program is instant and a run cut short keeps what it compiled.
"""
from tpu_costs.compiled_programs import command_line

if __name__ == "__main__":
    command_line()
