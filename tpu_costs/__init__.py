"""The TPU cost model: the slice table (slices.py: chips, hosts, peaks, compile-only
topologies), what a run costs at an MFU or from its compiled programs (run_costs.py), the run's
programs compiled for a TPU slice by libtpu's compile-only client (compiled_programs.py, the
library of tpu_compile.py), the compiled HLO's statistics (hlo_stats.py) and the memory-bounded
processes the compiles run in (bounded_processes.py). Every figure names its source: read from
the compiled program, or assumed (the chips' published figures, an MFU)."""
