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
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import tyro

from model import TRMConfig
from testtime import noisy_trajectories
from testtime import settings as testtime_settings
from testtime.batches import batch_puzzles
from tpu_costs import hlo_stats
from tpu_costs.run_costs import PAPER_DATASETS, eval_ms_per_puzzle
from tpu_costs.slices import Topology, slice_spec, topology
from training.config import PRESETS, Config, ConfigError, check_batch_layout, check_config, presets_for
from training.model_flops import model_flops

PROGRAMS = ("train_step", "eval_step")
CACHE_DIR = os.path.expanduser(os.environ.get("TRM_TPU_COMPILE_CACHE", "~/.cache/trm-tpu-compile"))


@dataclass
class CompileCommand:
    """tpu_compile.py's own flags; every other flag is a train.py setting of the preset."""

    slice: str = "v4-8"
    """The TPU slice to compile for: v4-N (N TensorCores), v5p-N, v5e-N or v6e-N (N chips)."""
    programs: tuple[Literal["train_step", "eval_step"], ...] = PROGRAMS
    """Which programs to compile."""
    json: str | None = None
    """Also write the results to this JSON file."""
    table_rows: int | None = None
    """Rows of the puzzle-embedding table (default: the preset's paper dataset's, PAPER_DATASETS)."""
    top: int = 10
    """Largest operations (by bytes) to list per program."""
    cache: bool = True
    """Reuse a cached result of the same program and topology (--no-cache compiles again)."""
    jobs: int | None = None
    """Processes at once (each trace and each compile runs in one that ends); None: as many as the memory allows."""
    config: Annotated[Config, tyro.conf.arg(name="")] = field(default_factory=Config)


# ----------------------------------------------------------------------------------------------
# Tracing (torch_xla's CPU runtime, the slice's device count)


def narrowed_model(model: TRMConfig, width: int = 64) -> TRMConfig:
    """The preset's model at a narrow width (tests): hidden size, heads and puzzle embedding
    narrowed; sequence, cycles, layers, halting, positions, mixer and dtype kept."""
    return dataclasses.replace(model, hidden_size=width, num_heads=max(1, width // 32),
                               puzzle_emb_ndim=width if model.puzzle_emb_ndim else 0)


def resolved_config(config: Config, preset: str, table_rows: int | None) -> Config:
    """The config as a run on the preset's dataset resolves it: the puzzle-embedding table's rows."""
    rows = table_rows or (PAPER_DATASETS[preset].puzzle_identifiers if preset in PAPER_DATASETS
                          else config.model.num_puzzle_identifiers)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, num_puzzle_identifiers=rows))


def program_settings(config: Config) -> str:
    """The settings that shape a run's programs (runs equal in these compile the same programs)."""
    return json.dumps({"model": dataclasses.asdict(config.model), "batch": config.optim.global_batch_size,
                       "optim": [config.optim.optimizer, config.optim.ema_rate],
                       "table_split": config.run.shard_puzzle_table,
                       "trajectories": _evaluation_setting(config)}, sort_keys=True)


def _evaluation_setting(config: Config) -> list:
    """[K, noise] of training's evaluations, with [D, latent] after them where they are not the defaults."""
    setting = testtime_settings.training_eval_setting(config.eval, config.model.halt_max_steps)
    extra = [] if (setting.act_steps, setting.latent) == (config.model.halt_max_steps, "z_L") \
        else [setting.act_steps, setting.latent]
    return [setting.k, setting.noise, *extra]


PROJECT_DIR = Path(__file__).resolve().parent.parent  # the checkout: train.py and the packages
ENTRY_POINT = PROJECT_DIR / "tpu_compile.py"  # the command line, and compile_isolated's worker processes

# The project files whose code shapes a traced program or its figures (the compile cache's key):
# the traced code (model, optimizers, the captured step, the mesh) and what it imports from the
# project (tests/test_tpu_compile.py checks), the trainer that builds the step, and this reader.
PROGRAM_SOURCES = ("model.py", "modeling/attention.py", "modeling/device_grads.py", "modeling/field_ranges.py",
                   "modeling/schemes.py", "modeling/counter_hash.py", "training/optim.py", "training/trainer.py",
                   "training/capture.py", "training/halt_steps.py", "sharding.py", "tpu_costs/compiled_programs.py",
                   "tpu_costs/hlo_stats.py", "testtime/noisy_trajectories.py", "data.py", "rundir/storage.py",
                   "tpu_costs/slices.py")  # the chips' figures (peak, clock, HBM) that the estimates read


def program_key(config: Config, program: str, topo: Topology) -> str:
    """What names a compiled program before it is traced: the settings that shape it, the
    topology, the code that builds and reads it, and the compiler's versions."""
    code = b"".join((PROJECT_DIR / f).read_bytes() for f in PROGRAM_SOURCES)
    where = {"program": program, "topology": [topo.name, topo.chip.chip_config, topo.chips_per_host],
             "versions": list(_versions().values())}
    return hashlib.sha256((program_settings(config) + json.dumps(where)).encode() + code).hexdigest()[:24]


Traced = tuple[bytes, list[int], dict[int, str]]  # HLO module, donated parameters, {state parameter: sharding}


@contextlib.contextmanager
def _state_as_shapes(sharding):
    """Within: a module moved to the XLA device (Trainer's model.to), and the puzzle table split
    by rows, get uninitialised XLA tensors (no device buffers). The trace needs shapes, not values;
    on the CPU mesh a replicated value is a buffer per device (32 of every weight, moment and EMA
    weight for a v4-64)."""
    to, rows_to_device = torch.nn.Module.to, sharding.rows_to_device
    torch.nn.Module.to = lambda module, device: module.to_empty(device=device)
    sharding.rows_to_device = lambda table, mesh: torch.empty(table.shape, dtype=table.dtype, device=sharding.device())
    try:
        yield
    finally:
        torch.nn.Module.to, sharding.rows_to_device = to, rows_to_device


def trace(config: Config, programs: tuple[str, ...], devices: int) -> dict[str, Traced]:
    """{program: Traced} of the run's steps, traced on a CPU mesh of `devices` devices (this
    process's runtime: start it with that many). The training state is placeholders (no buffers:
    `_state_as_shapes`), unannotated parameters whose shardings as a run has them (replicated,
    the table split by rows) `compile_hlo` sets; the batch and the carries are real."""
    os.environ.setdefault("XLA_HLO_DEBUG", "1")  # source lines in the ops' metadata
    os.environ["CPU_NUM_DEVICES"] = str(devices)  # the slice's count, whatever the caller's environment says
    import sharding

    sharding.start_runtime("cpu", devices)
    if sharding.device_counts()[0] != devices:
        raise RuntimeError(f"this process's CPU runtime has {sharding.device_counts()[0]} devices, not {devices}: "
                           "trace in a new process (python tpu_compile.py)")
    traced = _trace_programs(config, programs, sharding)
    gc.collect()  # nothing traced outlives the trace: a later sync here would run it on the placeholders (a crash)
    return traced


def _trace_programs(config: Config, programs: tuple[str, ...], sharding) -> dict[str, Traced]:
    import torch_xla.core.xla_builder as xb

    from training.capture import program_hlo
    from training.trainer import Trainer

    mesh = sharding.data_mesh()
    with _state_as_shapes(sharding):
        trainer = Trainer(config, sharding, mesh)
    for state in trainer.state_tensors():
        state.set(xb.create_placeholder_tensor(state.get().shape, state.get().dtype))
    row_split = {id(s.get()) for s in trainer.state_tensors() if s.name in trainer.row_split}
    split_text = sharding.row_split_text(mesh)

    def state_shardings(state: list, parameters: list[int]) -> dict[int, str]:
        return {pid: split_text if id(t) in row_split else "{replicated}" for t, pid in zip(state, parameters)
                if pid != -1}

    batch_size, seq_len = config.optim.global_batch_size, config.model.seq_len
    rng = np.random.default_rng(0)
    host_batch = {"inputs": rng.integers(1, config.model.vocab_size, (batch_size, seq_len), dtype=np.int32),
                  "labels": rng.integers(0, config.model.vocab_size, (batch_size, seq_len), dtype=np.int32),
                  "puzzle_identifiers": rng.integers(0, config.model.num_puzzle_identifiers, batch_size,
                                                     dtype=np.int32)}
    batch = sharding.host_batch_to_global(host_batch, mesh)
    trainer.init_carries(batch)
    sharding.sync()  # the carries become device data: the programs' inputs, as the state's placeholders are
    traced = {}
    if "eval_step" in programs:  # first: the training step below leaves the state pending
        with trainer.ema.swapped_into(trainer.model):
            trainer.model.eval()
            # at K trajectories (noisy_trajectories.py) the same rows hold each host's rows // K puzzles, at depth D
            setting = testtime_settings.training_eval_setting(config.eval, config.model.halt_max_steps)
            noisy_trajectories.set_evaluation(trainer, setting)
            outputs = list(trainer.eval_act_step(batch, trainer.eval_sums())) + trainer.eval_state() + \
                list(trainer.eval_carry.tensors().values())
            state = [s.get() for s in trainer.state_tensors()]
            hlo, donors, parameters = program_hlo(outputs, donated=[], parameters=state)
            traced["eval_step"] = (hlo, donors, state_shardings(state, parameters))
            trainer.model.train()
        del outputs
    if "train_step" in programs:
        state = [s.get() for s in trainer.state_tensors()]
        donated = [s.get() for s in trainer.state_tensors() if s.written_by_step]
        metrics = trainer.step(batch, config.optim.lr, config.optim.puzzle_emb_lr)
        written = [s.get() for s in trainer.state_tensors() if s.written_by_step]
        hlo, donors, parameters = program_hlo([metrics] + written + list(trainer.carry.tensors().values()), donated,
                                              parameters=state)
        traced["train_step"] = (hlo, donors, state_shardings(state, parameters))
    return traced


# ----------------------------------------------------------------------------------------------
# Compiling (libtpu's compile-only client)


class CompileError(RuntimeError):
    pass


def require_compiler() -> None:
    """CompileError saying how to install it when jax with libtpu is missing."""
    from importlib.util import find_spec

    if find_spec("jax") is None or find_spec("libtpu") is None:
        raise CompileError("the TPU compiler needs jax with libtpu: pip install 'jax[tpu]==0.10.2' (Python 3.11+; "
                           "requirements-test.txt has it)")


def _quiet_libtpu(topo: Topology) -> None:
    """libtpu would otherwise query a TPU VM's metadata server and warn when there is none (these
    variables answer it: the compile needs only the topology), and refuse to load in a second
    process at once (its lockfile guards chips; here there are none)."""
    for key, value in {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": topo.slice,
                       "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}.items():
        os.environ.setdefault(key, value)


def compile_hlo(hlo: bytes, donors: list[int], topo: Topology, shardings: dict[int, str] | None = None
                ) -> tuple[object, float]:
    """(compiled executable, seconds) of an HLO module for the topology's abstract devices, as
    torch_xla's SPMD executor compiles it: partitioned over every device, outputs' shardings
    propagated, donated inputs marked, `shardings` ({parameter number: HLO sharding}) set on the
    parameters the module leaves unannotated. CompileError with the compiler's message if it refuses."""
    shardings = shardings or {}
    _quiet_libtpu(topo)
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topo.name,
                                           chip_config_name=topo.chip.chip_config,
                                           chips_per_host_bounds=topo.chips_per_host, num_slices=1).devices
    if len(devices) != topo.devices:
        raise CompileError(f"libtpu's {topo.name} has {len(devices)} devices, expected {topo.devices}")
    client = devices[0].client
    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                           device_assignment=np.array([d.id for d in devices]).reshape(1, -1),
                                           backend=client)
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]
    with mlir.make_ir_context():
        module = ir.Module.parse(xla_client._xla.mlir.hlo_to_stablehlo(hlo))
        main = module.body.operations[0] if len(module.body.operations) == 1 else \
            next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        arguments = list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else None
        if (donors or shardings) and arguments is not None:  # the conversion drops torch_xla's buffer donors
            marked = []
            for i, attrs in enumerate(arguments):
                entries = {a.name: a.attr for a in ir.DictAttr(attrs)}
                if i in donors:
                    entries["jax.buffer_donor"] = ir.BoolAttr.get(True)
                if i in shardings:
                    entries.setdefault("mhlo.sharding", ir.StringAttr.get(shardings[i]))
                marked.append(ir.DictAttr.get(entries))
            main.attributes["arg_attrs"] = ir.ArrayAttr.get(marked)
        started = time.perf_counter()
        try:
            executable = client.compile(module, xla_client.DeviceList(tuple(devices)), options)
        except Exception as e:  # noqa: BLE001 - jax's XlaRuntimeError: the compiler's own words
            raise CompileError(str(e)) from None
    return executable, time.perf_counter() - started


def analyse(executable, topo: Topology, model_flops_per_device: float, top: int, sequence: int) -> dict:
    """What the compiled program says: memory, FLOPs, bytes, collectives, estimates, and the
    shapes of its [..., sequence, sequence] results (attention scores written to HBM)."""
    memory = executable.get_compiled_memory_stats()
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = executable.hlo_modules()[0].to_string()
    stats = hlo_stats.summary(text, top, sequence)
    hbm = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
           "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes,
           "code": memory.generated_code_size_in_bytes}
    hbm["total"] = hbm["arguments"] + hbm["outputs"] - hbm["aliased"] + hbm["temporaries"] + hbm["code"]
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    chip = topo.chip
    compute_ms = flops / (chip.peak_tflops * 1e12) * 1e3
    memory_ms = accessed / (chip.hbm_gb_per_s * 1e9) * 1e3
    xla_ms = stats["estimated_cycles"] / (chip.clock_ghz * 1e9) * 1e3
    estimates = {"compute_bound_ms": compute_ms, "memory_bound_ms": memory_ms,
                 "roofline_ms": max(compute_ms, memory_ms), "xla_estimate_ms": xla_ms or None}
    # XLA's sum over operations of its own per-operation estimates when the program carries them
    # (each operation bound by its own compute or memory, nothing overlapped); else the
    # whole-program roofline, which assumes perfect overlap and is a lower bound.
    chosen = xla_ms if xla_ms else max(compute_ms, memory_ms)
    return {
        "compiled": True, "hbm_bytes": hbm, "hbm_capacity_bytes": chip.hbm_bytes,
        "flops": flops, "model_flops": model_flops_per_device, "bytes_accessed": accessed,
        "collectives": stats["collectives"], "bytes_by_kind": stats["bytes_by_kind"],
        "largest_operations": stats["largest_operations"], "estimates": estimates,
        "sequence_square_shapes": stats["sequence_square_shapes"], "hbm_side_bytes": stats["hbm_bytes"],
        "estimate_ms": chosen,
        "estimate_source": ("XLA's per-operation cycle estimates in the compiled program, at the chip's "
                            f"{chip.clock_ghz:g} GHz clock (assumed)") if xla_ms else
                           (f"roofline: the longer of FLOPs at {chip.peak_tflops:g} TFLOP/s and bytes at "
                            f"{chip.hbm_gb_per_s:g} GB/s (assumed)"),
        "mfu_ceiling": model_flops_per_device / (chip.peak_tflops * 1e12) / (chosen / 1e3) if chosen else None,
    }


# ----------------------------------------------------------------------------------------------
# The command


def _checked(config: Config, slice_name: str) -> Topology:
    topo = topology(slice_name)
    check_config(config)
    require_compiler()
    check_batch_layout(config.optim.global_batch_size, topo.devices, max(1, slice_spec(slice_name).hosts))
    return topo


def _cached(key: str, use_cache: bool = True) -> dict | None:
    path = Path(CACHE_DIR) / f"{key}.json"
    return dict(json.loads(path.read_text()), cached=True) if use_cache and path.exists() else None


def _store(key: str, result: dict) -> None:
    """A program's cache entry, written whole or not at all (a plan cut short leaves no half of one)."""
    Path(CACHE_DIR).mkdir(parents=True, exist_ok=True)
    partial = Path(CACHE_DIR) / f".{key}.{os.getpid()}.partial"
    partial.write_text(json.dumps(result))
    partial.replace(Path(CACHE_DIR) / f"{key}.json")


def clean_partials() -> int:
    """Remove the cache's .partial files (`_store`'s) whose writer has ended (killed mid-write);
    those of a process still running (another plan's) stay. Returns how many it removed."""
    removed = 0
    for path in Path(CACHE_DIR).glob(".*.partial") if Path(CACHE_DIR).is_dir() else ():
        try:
            os.kill(int(path.name.rsplit(".", 2)[-2]), 0)  # its writer runs
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except (ValueError, PermissionError):  # not a pid of ours, or another user's running process
            pass
    return removed


def compiled_result(traced: Traced, config: Config, program: str, topo: Topology, top: int = 10, say=print) -> dict:
    """The result dict of one traced program compiled for the topology (see `analyse`;
    `compiled` False with the compiler's `error` and advice when it refuses)."""
    say(f"compiling {program} for {topo.slice} ({topo.name}, {topo.devices} devices) with libtpu's compile-only "
        "client", flush=True)
    try:
        executable, seconds = compile_hlo(*traced[:2], topo, traced[2])
    except CompileError as e:  # a refusal is the compiler's answer too: cached like a program
        say(f"  refused: {str(e).splitlines()[0][:300]}", flush=True)
        return {"compiled": False, "error": str(e), "advice": _advice(str(e), config, topo.slice)}
    say(f"  compiled in {seconds:.0f}s", flush=True)
    flops = model_flops(config.model)
    model_per_device = flops["train" if program == "train_step" else "eval"] * config.optim.global_batch_size \
        / topo.devices
    extra = flops["train_extra" if program == "train_step" else "eval_extra"]
    return dict(analyse(executable, topo, model_per_device, top, config.model.total_len),
                extra_flops=extra * config.optim.global_batch_size / topo.devices, compile_s=seconds,
                compiler=_versions())


def _with_run_fields(results: dict[str, dict], config: Config, preset: str, topo: Topology, programs) -> list[dict]:
    setting = testtime_settings.training_eval_setting(config.eval, config.model.halt_max_steps)
    k, noise = setting.k, setting.noise
    common = {"preset": preset, "slice": topo.slice, "topology": topo.name, "devices": topo.devices,
              "global_batch": config.optim.global_batch_size, "cycles": [config.model.H_cycles, config.model.L_cycles],
              "batch_per_device": config.optim.global_batch_size // topo.devices}
    hosts = slice_spec(topo.slice).hosts  # each host's rows hold rows // K whole puzzles; K above them: refused
    try:
        per_batch = batch_puzzles(config.optim.global_batch_size, k, hosts)
    except ValueError:
        per_batch = 0
    evaluation = {"trajectories": k, "noise": noise, "halt_max_steps": config.model.halt_max_steps,
                  "act_steps": setting.act_steps, "noise_latent": setting.latent, "hosts": hosts,
                  "puzzles_per_batch": per_batch}
    return [dict(common, program=p, **(evaluation if p == "eval_step" else {}), **results[p]) for p in programs]


def compile_programs(config: Config, preset: str, slice_name: str, programs=PROGRAMS, top: int = 10,
                     use_cache: bool = True, say=print) -> list[dict]:
    """Trace and compile each program of the run for the slice (or read its cached result), in
    this process (its runtime must have the slice's device count; what each program leaves
    behind stays: `compile_isolated` runs them in processes that end); one result dict per
    program (see `analyse`; `compiled` False with the compiler's `error`)."""
    topo = _checked(config, slice_name)
    keys = {p: program_key(config, p, topo) for p in programs}
    results = {p: r for p in programs if (r := _cached(keys[p], use_cache)) is not None}
    missing = [p for p in programs if p not in results]
    if missing:
        say(f"tracing {', '.join(missing)} of {preset} (global batch {config.optim.global_batch_size}) on a "
            f"{topo.devices}-device CPU mesh", flush=True)
        started = time.perf_counter()
        traced = trace(config, tuple(missing), topo.devices)
        say(f"  traced in {time.perf_counter() - started:.0f}s", flush=True)
    for program in missing:
        results[program] = compiled_result(traced[program], config, program, topo, top, say)
        _store(keys[program], results[program])
        results[program]["cached"] = False
    return _with_run_fields(results, config, preset, topo, programs)


def cached_results(config: Config, slice_name: str, programs=PROGRAMS) -> list[dict] | None:
    """The cached results of each program for the slice, or None if one is not cached."""
    topo = topology(slice_name)
    found = []
    for program in programs:
        path = Path(CACHE_DIR) / f"{program_key(config, program, topo)}.json"
        if not path.exists():
            return None
        found.append(dict(json.loads(path.read_text()), program=program, cached=True))
    return found


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 100 else f"{seconds:.0f}s"


def compile_isolated(jobs: list[tuple], programs=PROGRAMS, top: int = 10, use_cache: bool = True,
                     processes: int | None = None, say=print, labels: list[str] | None = None) -> list[list[dict]]:
    """compile_programs for each (preset, config, slice) of `jobs` (or its cached results; a job
    (preset, config, slice, its programs) names its own programs instead of `programs`), in
    processes that end (tpu_costs/bounded_processes.py; `processes` at once, None: as many as the memory
    allows): one trace per distinct (settings, slice) writes the HLO, one compile per program
    writes its cache entry at once (a run cut short keeps it). A line per program as it ends: its
    time, its process's peak memory (the OS's), how many remain; `labels` name the jobs."""
    from tpu_costs import bounded_processes

    started, tmp = time.perf_counter(), Path(tempfile.mkdtemp(prefix="trm-tpu-compile-"))
    wanted = [tuple(job[3]) if len(job) > 3 else tuple(programs) for job in jobs]
    jobs = [job[:3] for job in jobs]
    topos = [_checked(config, slice_name) for _, config, slice_name in jobs]
    keys = [{p: program_key(config, p, topo) for p in wanted[i]}
            for i, ((_, config, _), topo) in enumerate(zip(jobs, topos))]
    traces: dict[tuple, tuple[int, list[str]]] = {}  # (settings, slice) -> (first job, the programs not cached)
    for i, (_, config, slice_name) in enumerate(jobs):
        missing = [p for p in wanted[i] if _cached(keys[i][p], use_cache) is None]
        if missing:
            first, before = traces.get((program_settings(config), slice_name), (i, []))
            traces[(program_settings(config), slice_name)] = (first, before + [p for p in missing if p not in before])
            keys[first].update({p: keys[i][p] for p in missing})
    total = sum(len(missing) for _, missing in traces.values())
    progress, fresh = {"done": 0, "peak": 0}, set()

    def worker(kind: str, request: dict, name: str) -> list[str]:
        (tmp / f"{name}.json").write_text(json.dumps(request))
        return [sys.executable, str(ENTRY_POINT), "--worker", kind, str(tmp / f"{name}.json")]

    def compiled(program: str, key: str, label: str):
        def then(done) -> list:
            progress["done"] += 1
            progress["peak"] = max(progress["peak"], done.peak_bytes)
            entry = _cached(key)
            failed = done.returncode != 0 or entry is None
            say(f"[{progress['done']}/{total}] {label} {program}: "
                + (f"FAILED (exit {done.returncode})" if failed else
                   f"{'compiled' if entry['compiled'] else 'refused by the compiler'} in {done.seconds:.0f}s")
                + f", process peak {done.peak_bytes / 1e9:.1f} GB (measured); {total - progress['done']} to go, "
                f"{_minutes(time.perf_counter() - started)} so far", flush=True)
            if failed:
                failures.append(f"{label} {program}: {done.output.strip()[-1500:]}")
            else:
                fresh.add(key)
            return []
        return then

    def traced(i: int, missing: list[str], label: str):
        def then(done) -> list:
            progress["peak"] = max(progress["peak"], done.peak_bytes)
            if done.returncode != 0:
                progress["done"] += len(missing)
                failures.append(f"tracing {label} (exit {done.returncode}): {done.output.strip()[-1500:]}")
                say(f"tracing {label} FAILED (exit {done.returncode}); {total - progress['done']} to go", flush=True)
                return []
            say(f"  traced {label} in {done.seconds:.0f}s, process peak {done.peak_bytes / 1e9:.1f} GB (measured)",
                flush=True)
            preset, config, slice_name = jobs[i]
            return [bounded_processes.Task(f"{label} {p}", worker("compile", {
                "preset": preset, "config": dataclasses.asdict(config), "slice": slice_name, "program": p,
                "top": top, "key": keys[i][p], "hlo": str(tmp / f"{i}-{p}.hlo")}, f"{i}-{p}"),
                f"compile {p} {preset} {slice_name}", compiled(p, keys[i][p], label)) for p in missing]
        return then

    failures, tasks = [], []
    for i, missing in traces.values():
        preset, config, slice_name = jobs[i]
        label = f"{labels[i] if labels else f'{preset} (batch {config.optim.global_batch_size})'} for {slice_name}"
        tasks.append(bounded_processes.Task(label, worker("trace", {
            "config": dataclasses.asdict(config), "slice": slice_name, "programs": missing, "out": str(tmp),
            "job": i}, f"{i}-trace"), f"trace {preset} {slice_name}", traced(i, missing, label)))
    if tasks:
        say(f"{total} program(s) to compile, {len(tasks)} trace(s) first; "
            + (f"{processes} process(es) at once" if processes else
               "as many processes at once as the memory allows (measured)"), flush=True)
    try:
        bounded_processes.run(tasks, processes)
    except KeyboardInterrupt:
        say(f"interrupted: {len(fresh)} of {total} program(s) compiled and cached; the same command again compiles "
            "the rest", flush=True)
        raise
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        clean_partials()  # what a compile killed mid-write left (its process has ended by now)
    if tasks:
        say(f"compiled {total - len(failures)} of {total} program(s) in {_minutes(time.perf_counter() - started)}; "
            f"the largest process peaked at {progress['peak'] / 1e9:.1f} GB (measured)", flush=True)
    if failures:
        raise CompileError("compiling failed:\n" + "\n".join(failures))
    return [_with_run_fields({p: dict(_cached(keys[i][p]), cached=keys[i][p] not in fresh) for p in wanted[i]},
                             config, preset, topos[i], wanted[i]) for i, (preset, config, _) in enumerate(jobs)]


def _worker(kind: str, request_path: str) -> None:
    """compile_isolated's process: `trace` writes each program's HLO, `compile` one's cache entry."""
    from training.config import config_from_dict

    request = json.loads(Path(request_path).read_text())
    config, topo = config_from_dict(request["config"]), topology(request["slice"])
    if kind == "trace":
        for program, (hlo, donors, shardings) in trace(config, tuple(request["programs"]), topo.devices).items():
            Path(request["out"], f"{request['job']}-{program}.hlo").write_bytes(hlo)
            Path(request["out"], f"{request['job']}-{program}.parameters").write_text(
                json.dumps({"donors": donors, "shardings": shardings}))
        return
    hlo = Path(request["hlo"])
    parameters = json.loads(hlo.with_suffix(".parameters").read_text())
    shardings = {int(k): v for k, v in parameters["shardings"].items()}
    _store(request["key"], compiled_result((hlo.read_bytes(), parameters["donors"], shardings), config,
                                           request["program"], topo, request["top"]))


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("jax", "libtpu", "torch_xla"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _advice(error: str, config: Config, slice_name: str) -> str:
    if "RESOURCE_EXHAUSTED" in error or "Ran out of memory" in error:
        batch = config.optim.global_batch_size
        plain = not config.model.mlp_t and config.model.attention == "sdpa"
        return ("the program does not fit in HBM: "
                + ("use the blockwise attention (--model.attention blockwise), which never holds the "
                   "[batch, heads, seq, seq] scores, or " if plain else "use ")
                + f"a smaller global batch (--optim.global-batch-size "
                f"{batch // 2}, with a proportionally smaller --optim.lr if you want the same recipe) or a "
                f"larger slice than {slice_name} (more devices, fewer examples each)")
    return "the TPU compiler refused the program: the message above names the operation"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def format_results(results: list[dict]) -> str:
    lines = []
    for r in results:
        head = (f"{r['preset']} {r['program']} on {r['slice']} ({r['topology']}, {r['devices']} devices, "
                f"{r['batch_per_device']} examples per device)")
        if not r["compiled"]:
            lines += [head, f"  NOT COMPILED: {r['error'].strip()[:2000]}", f"  what to do: {r['advice']}", ""]
            continue
        hbm, est = r["hbm_bytes"], r["estimates"]
        fits = "fits" if hbm["total"] <= r["hbm_capacity_bytes"] else "DOES NOT FIT"
        lines += [
            head + (" [cached]" if r.get("cached") else f" [compiled in {r['compile_s']:.0f}s]"),
            f"  HBM per device (GB): {_gb(hbm['total'])} of {_gb(r['hbm_capacity_bytes'])} ({fits}): arguments "
            f"{_gb(hbm['arguments'])}, outputs {_gb(hbm['outputs'])}, aliased {_gb(hbm['aliased'])}, temporaries "
            f"{_gb(hbm['temporaries'])}, code {_gb(hbm['code'])}",
            f"  FLOPs per device: {r['flops']:.3g} (projection.model_flops: {r['model_flops']:.3g}"
            + (f" + the blockwise attention's extra {r['extra_flops']:.3g}" if r.get("extra_flops") else "")
            + f", ratio {r['flops'] / (r['model_flops'] + r.get('extra_flops', 0)):.3f})",
            f"  bytes accessed per device: {_gb(r['bytes_accessed'])} GB (the compiler's count, on-chip memory "
            f"included); in HBM: {_gb(r.get('hbm_side_bytes', 0))} GB (hlo_stats.hbm_bytes)",
            "  collectives: " + ("; ".join(f"{c['count']} {c['kind']} ({c['bytes'] / 1e6:.2f} MB: "
                                           f"{', '.join(c['shapes'][:4])})" for c in r["collectives"]) or "none"),
            f"  step time (ms): compute-bound {est['compute_bound_ms']:.2f}, memory-bound "
            f"{est['memory_bound_ms']:.2f}, "
            + (f"XLA's estimate {est['xla_estimate_ms']:.2f}" if est.get("xla_estimate_ms") else "no XLA estimate")
            + f" -> {r['estimate_ms']:.2f} ms ({r['estimate_source']}); MFU ceiling {r['mfu_ceiling']:.0%}",
        ] + ([f"  per test puzzle: {eval_ms_per_puzzle(r):.4f} ms of device time "
              f"({r.get('act_steps', r['halt_max_steps'])} ACT steps of "
              f"{r['estimate_ms']:.2f} ms over {r['puzzles_per_batch']} puzzles a batch: K={r['trajectories']} "
              f"trajectories each, noise {r['noise']:g}; --eval.trajectories sets K, --eval.act-steps D)"]
             if eval_ms_per_puzzle(r) is not None else [f"  per test puzzle: none: K={r['trajectories']} exceeds "
             "a host's rows of the batch: refused"] if r.get("compiled") and r.get("hosts") else []) + [
            "  results of shape [..., seq, seq] (attention scores in HBM): "
            + (", ".join(r.get("sequence_square_shapes", [])[:4]) or "none"),
            "  bytes by kind of operation: " + ", ".join(f"{k['kind']} {k['count']}x {_gb(k['bytes'])} GB"
                                                        for k in r["bytes_by_kind"][:8]),
            "  largest operations:",
        ]
        lines += [f"    {op['bytes'] / 1e9:7.3f} GB  {op['kind']:<28} {op['shape'][:70]:<70}  {op['source']}"
                  for op in r["largest_operations"]]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[str, CompileCommand]:
    if not argv or argv[0] not in PRESETS:
        raise SystemExit(f"usage: python tpu_compile.py PRESET [--slice SLICE] [train.py flags]; PRESET is one of "
                         f"{', '.join(PRESETS)}" + (" (--help after a preset lists every flag)" if argv else ""))
    preset = argv[0]
    return preset, tyro.cli(CompileCommand, args=argv[1:], default=CompileCommand(config=presets_for(argv)[preset][1]),
                            prog=f"tpu_compile.py {preset}", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> list[dict]:
    preset, args = parse_args(sys.argv[1:] if argv is None else argv)
    config = resolved_config(args.config, preset, args.table_rows)
    try:
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: give at least 1 process (or leave it out: sized from the memory)")
        (results,) = compile_isolated([(preset, config, args.slice)], args.programs, args.top, args.cache, args.jobs)
    except (ConfigError, ValueError, CompileError) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit(130)
    print()
    print(format_results(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"programs": results}, indent=2))
        print(f"wrote {args.json}")
    if not all(r["compiled"] for r in results):
        raise SystemExit(1)
    return results


def command_line() -> None:
    """tpu_compile.py's entry: a user's command, or one of compile_isolated's worker processes."""
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], sys.argv[3])
    else:
        main()
