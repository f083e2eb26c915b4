"""Cost of one TRM training step and of a whole paper run: model FLOPs, the device time a TPU
slice needs for them at full speed, what this machine measures for the real step (host time,
device time, compiles, CPU fallbacks, device-to-host transfers, data rate, the checkpoint pause,
the state's bytes per device), and the wall time of the preset's recipe on the slice.

    python bench.py                                   # every preset at its real size, slice v4-64
    python bench.py --presets sudoku-mlp arc1 --batch 8 --steps 10 --slice v4-64 --json bench.json
    python bench.py --presets arc1 --cpu-devices 4 --mfu 0.3   # fewer virtual devices (memory), 30% MFU
    python bench.py --flops-only --slice v6e-64       # the FLOP and projection columns only, no device needed
    python bench.py --tiny --presets sudoku-mlp       # a tiny model (hidden 32) of each preset, for tests
    python bench.py --flops-only --device-time mfu --mfu 0.3   # at an MFU a TPU measured, no compile

Without a TPU it runs on a virtual CPU mesh of 8 devices; on a TPU VM it measures the TPU
(`--device tpu`). Each preset is measured on a synthetic dataset of
its shape (random tokens, the preset's seq_len and vocabulary, a puzzle-embedding table of the
real dataset's size, `--table-rows`) written to a temporary directory, with the real
`trainer.Trainer` and `TrainBatches`: warmup steps first (they compile), then `--steps`
timed steps, each started on an idle device, at the preset's learning rates after warmup, then
the evaluation ACT steps, then the checkpoint copy of every host of the slice. Times are medians
over the timed steps. bench.py exits non-zero, naming the preset and the step, when a step's
training loss is not finite (after printing the tables and the JSON).

Columns (the JSON file has these and more, with units in the names; see `bench_preset`):
  params         trainable parameters (the puzzle-embedding table, a SignSGD buffer, not counted)
  GF/ex train    model GFLOP per example of one training step (one ACT segment, forward and
                 backward; formula in tpu_costs/run_costs.py's `model_flops`); GF/ex eval: of one evaluation ACT step
                 (an evaluation batch runs halt_max_steps = 16 of them)
  dev@peak ms    device time of a training step of the global batch (768) at the slice's bf16 peak
  host ms        wall time of the host's work for one step in the training loop's thread:
                 waiting for the step's batch (data.PrefetchedBatches reads and uploads it on
                 a background thread during the step before), Trainer.step (replaying the
                 captured step, or re-tracing it with --no-capture-step) and torch_xla.sync(),
                 which only dispatches; every step starts on an idle device (*)
  cpu ms         CPU time over the same span of the threads doing that work (the Python thread
                 and the autograd thread that traces backward): unlike host ms it does not grow
                 when other threads (other processes, or XLA's own) compete for the cores, so a
                 host with idle cores (a TPU VM) should see host ms close to it
  data ms        the part of host ms spent waiting for the batch
  bg data ms     wall time of the background thread's TrainBatches.batch + host_batch_to_global for one step (it runs
                 while the loop's thread works on the step before, so both compete for the cores and the GIL; hidden
                 as long as it is shorter than a step)
  trace ms       the part in Trainer.step; sync ms: the part in torch_xla.sync()
  dev ms         device execution time per step measured here (XLA metric ExecuteReplicatedTime)
  eval host ms   host time of one evaluation ACT step (Trainer.eval_act_step and sync, measured like host ms without
                 the data wait; same warmup and step counts): replayed, or re-traced with --no-capture-step
  ckpt ms        the training loop's pause for one checkpoint: the longest over the slice's hosts of
                 Trainer.checkpoint_shards(host, layout), the copy of that host's share of the state to its memory
                 (the fastest of --checkpoint-repeats, each from an idle device: the copy's own cost, which other
                 work on the cores only adds to; the files are written on a background thread; `measure_checkpoint`)
  ckpt MB/host   the most bytes one host copies; ckpt MB: the whole checkpoint (state and carry)
  MB/device      bytes one device holds of the training state (every named_state tensor) and the ACT carries of the
                 measured batch, from the sharding annotations (sharding.bytes_per_device); table MB/device: the
                 puzzle-embedding table's part
  compiles       graphs compiled for this preset (seconds); none after the warmup (`compiles_in_timed_steps`)
  fallbacks      aten:: CPU fallbacks per timed step; D2H: device-to-host transfers per step
  rows/s/host    rows per second one host gets from TrainBatches alone (its share of the global batch)
  host/peak      host ms / dev@peak ms (cpu/peak: cpu ms / dev@peak ms): above 1 the host, not
                 the TPU, limits the step rate
  loss           training loss of the last timed step as train.py logs it (lm_loss + 0.5 q_halt_loss
                 per example; random tokens: only its finiteness means something); every step's in the JSON

(*) After each step the script reads an output of the step and waits for the other threads to be
idle (`settle`). A CPU device shares the host's cores, and sync() often sleeps while its threads run
the step: on CPU sync counts its thread's CPU time (wall: `sync_wall_ms_per_step`), on TPU its wall.
The JSON keeps every step's numbers under `steps`. A preset whose step graph equals one
compiled earlier in the same run (arc2 after arc1) compiles nothing.

The second table projects the paper's recipe (epochs, evaluations, checkpoints) on the real
dataset (PAPER_DATASETS) to the slice: each step takes the longer of its measured host time and
its device time, the compiled TPU program's estimate (tpu_compile.py; --device-time mfu: the
FLOPs at --mfu of the peak) (`project_paper_run`; `paper_run` in the JSON): train steps (epochs x
total_groups x mean_puzzle_examples / global batch), ms/step, train h, evals (every
eval.every_epochs and the final one), eval ACT steps (halt_max_steps per test batch), eval h,
ckpts and their pauses (ckpt min), total h (start-up, compiles and restarts not counted).
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tyro

import data
from data import PrefetchedBatches, TrainBatches, train_rows_per_second
from model import TRM, TRMConfig
from tpu_costs import compiled_programs, run_costs
from tpu_costs.run_costs import PAPER_DATASETS, flop_record, project_paper_run
from tpu_costs.slices import SliceSpec, slice_spec
from training import run_log
from training import trainer as trainer_module  # `trainer` names the Trainer instance below
from training.config import PRESETS, Config, ConfigError, check_against_dataset, check_batch_layout

PresetName = Literal["sudoku-mlp", "sudoku-att", "maze", "arc1", "arc2"]
PRESET_NAMES: tuple[PresetName, ...] = ("sudoku-mlp", "sudoku-att", "maze", "arc1", "arc2")


@dataclass
class BenchConfig:
    presets: tuple[PresetName, ...] = PRESET_NAMES
    """Presets to measure, each at its real model size."""
    slice: str = "v4-64"
    """TPU slice of the projection: v4-N (N TensorCores, N/2 chips), v5e-N or v6e-N (N chips)."""
    batch: int | None = None
    """Global batch of the measured steps (default: one row per device, 8 on the CPU mesh)."""
    steps: int = 5
    """Timed training steps per preset (medians are reported)."""
    warmup: int = 2
    """Untimed steps before them (the first compiles)."""
    json: str | None = None
    """Also write the records to this JSON file."""
    flops_only: bool = False
    """Print the FLOP and projection columns only; start no runtime, measure nothing."""
    tiny: bool = False
    """Replace each preset's model by a tiny one (hidden 32, 2+2 cycles) for a quick check."""
    forward_dtype: Literal["bfloat16", "float32", "float16"] | None = None
    """Override the activation dtype of the measured model (the presets use bfloat16)."""
    data_batches: int = 50
    """Global batches of 768 read to measure the data rate (repeated 3 times)."""
    device: Literal["auto", "tpu", "cpu"] = "auto"
    """auto (TPU if attached or PJRT_DEVICE says so), tpu (fail without one), cpu (virtual mesh)."""
    cpu_devices: int = 8
    """Virtual devices of the CPU mesh (device cpu)."""
    capture_step: bool = True
    """Time the captured step (run.capture_step, the training loop's default); with
    --no-capture-step, the step re-traced in Python every time."""
    shard_puzzle_table: bool = True
    """Split the puzzle-embedding table by rows over the devices (run.shard_puzzle_table, the
    default); --no-shard-puzzle-table measures it replicated on every device."""
    table_rows: int | None = None
    """Rows of the puzzle-embedding table (default: the preset's real dataset's identifiers,
    PAPER_DATASETS; the synthetic data uses few of them, only the table's size matters)."""
    checkpoint_repeats: int = 3
    """Times each host's checkpoint copy is timed (the fastest is reported)."""
    mfu: float = 0.4
    """Model FLOPs utilisation of the paper-run projection with --device-time mfu (device time = dev@peak / mfu)."""
    device_time: Literal["compiled", "mfu"] = "compiled"
    """Device time of the projection: each step compiled for the slice by the TPU compiler (tpu_compile.py) or --mfu."""
    trajectories: int = 1
    """Project (and compile) the evaluations at K trajectories per test puzzle (eval.trajectories,
    testtime/noisy_trajectories.py)."""


# ----------------------------------------------------------------------------------------------
# Configurations and synthetic data


def tiny_model(model: TRMConfig) -> TRMConfig:
    """The preset's architecture (mixer, positions, seq_len, vocabulary) at a tiny size."""
    return dataclasses.replace(model, hidden_size=32, num_heads=2, expansion=2.0, H_cycles=2, L_cycles=2,
                               puzzle_emb_ndim=32, puzzle_emb_len=2, halt_max_steps=4, forward_dtype="float32")


def bench_config(preset: str, args: BenchConfig) -> Config:
    config = PRESETS[preset][1]
    model = tiny_model(config.model) if args.tiny else config.model
    if args.forward_dtype:
        model = dataclasses.replace(model, forward_dtype=args.forward_dtype)
    evals = dataclasses.replace(config.eval, trajectories=str(args.trajectories))
    return dataclasses.replace(config, model=model, eval=evals,
                               run=dataclasses.replace(config.run, device=args.device, cpu_devices=args.cpu_devices,
                                                       capture_step=args.capture_step,
                                                       shard_puzzle_table=args.shard_puzzle_table))


def write_synthetic_dataset(root: str, preset: str, model: TRMConfig, table_rows: int, seed: int = 0) -> data.Metadata:
    """A train split shaped like the preset's data: random tokens, its seq_len and vocabulary,
    and a puzzle-embedding table of `table_rows` rows (the real table: PAPER_DATASETS).

    Sudoku and maze: 1000 groups of 16 one-example puzzles, all with identifier 0 (the real sets
    have 1 identifier; Sudoku groups hold 1001 augmentations). ARC: 1000 groups of 8 puzzles of
    2 to 6 examples, one identifier per puzzle, taken from 1 .. table_rows - 1 (the real ARC sets
    have about 1M identifiers and up to 1001 puzzles per group; which rows a step reads changes
    no timing, the table's size changes memory and checkpoints).
    """
    rng = np.random.default_rng(seed)
    arc_like = preset.startswith("arc")
    groups, per_group = 1000, 8 if arc_like else 16
    puzzles = groups * per_group
    sizes = rng.integers(2, 7, size=puzzles) if arc_like else np.ones(puzzles, dtype=np.int64)
    examples = int(sizes.sum())
    inputs = rng.integers(1, model.vocab_size, size=(examples, model.seq_len), dtype=np.uint8)
    labels = rng.integers(0, model.vocab_size, size=(examples, model.seq_len), dtype=np.uint8)
    if arc_like and table_rows > 1:
        identifiers = 1 + np.arange(puzzles) % (table_rows - 1)
    else:
        identifiers = np.zeros(puzzles, dtype=np.int64)
    metadata = data.Metadata(
        pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=model.vocab_size, seq_len=model.seq_len,
        num_puzzle_identifiers=table_rows, total_groups=groups,
        mean_puzzle_examples=examples / puzzles, total_puzzles=puzzles, sets=("all",))
    data.write_split(root, "train", metadata, {
        "inputs": inputs, "labels": labels, "puzzle_identifiers": identifiers,
        "puzzle_indices": np.concatenate(([0], np.cumsum(sizes))),
        "group_indices": np.arange(0, puzzles + 1, per_group)})
    return metadata


# ----------------------------------------------------------------------------------------------
# Measurements


def data_rows_per_s(dataset: data.Dataset, global_batch: int, hosts: int, batches: int) -> float:
    """Rows per second host 0 of `hosts` gets from TrainBatches (median of 3 runs)."""
    return train_rows_per_second(dataset, global_batch, hosts, batches, runs=3)


class StepThreadsClock:
    """CPU time of the threads that do a step's host work: the Python thread that calls it and
    the autograd engine's device threads (`pt_autograd_*`), where backward is traced while the
    caller waits. Read from /proc/self/task/*/schedstat (ns) on Linux; elsewhere only the
    calling thread is counted."""

    def __init__(self):
        self.threads: list[int] = []

    def refresh(self) -> None:
        import os
        import threading

        self.threads = [threading.get_native_id()]
        try:
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().startswith("pt_autograd"):
                        self.threads.append(int(tid))
        except OSError:
            self.threads = []

    def ns(self) -> int:
        if not self.threads:
            return time.thread_time_ns()
        total = 0
        for tid in self.threads:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:  # a thread that ended
                pass
        return total


def settle(limit_s: float = 1.0, window_s: float = 0.02) -> float:
    """Wait (at most limit_s) until this process's other threads are idle; returns the seconds
    waited. A CPU device keeps its threads busy for a while after a step's outputs are ready
    (freeing its buffers), and that work would otherwise land in the next step's host time."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        p0, c0 = time.process_time(), time.thread_time()
        time.sleep(window_s)
        if (time.process_time() - p0) - (time.thread_time() - c0) < 0.1 * window_s:
            break
    return time.perf_counter() - start


def _device_time_ns() -> tuple[int, int]:
    """(executions, total ns) of compiled graphs so far (SPMD: ExecuteReplicatedTime)."""
    import torch_xla.debug.metrics as met

    for name in ("ExecuteReplicatedTime", "ExecuteTime"):
        found = met.metric_data(name)
        if found:
            return found[0], int(found[1])
    return 0, 0


def step_loss(metrics: np.ndarray, batch: int) -> float:
    """The training loss train.py logs (lm_loss + 0.5 q_halt_loss per example) of one step's
    metric vector."""
    row = run_log.window_metrics(trainer_module.TRAIN_METRICS, metrics, 1, batch)
    return row["lm_loss"] + 0.5 * row["q_halt_loss"]


def measure_training(config: Config, dataset: data.Dataset, sharding, batch: int, warmup: int,
                     steps: int, on_cpu: bool, hosts: int = 1, checkpoint_repeats: int = 1) -> dict:
    """Run warmup + timed training steps as train.training drives them; per-step times and counters."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    mesh = sharding.data_mesh()
    counters_start = sharding.xla_counters()
    trainer = trainer_module.Trainer(config, sharding, mesh)
    batches = TrainBatches(dataset, batch, seed=0, process_index=sharding.process_index(),
                                process_count=sharding.process_count())
    trainer.init_carries(sharding.host_batch_to_global(batches.batch(0), mesh))
    torch_xla.sync()
    background = {}  # step -> (wall ms, CPU ms) of reading and uploading its batch

    def load(step):
        c0, t0 = time.thread_time(), time.perf_counter()
        batch = sharding.host_batch_to_global(batches.batch(step - 1), mesh)
        background[step] = ((time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3)
        return batch

    prefetched = PrefetchedBatches(load, 1, warmup + steps)  # as train.py reads batches
    # The preset's learning rates after warmup (graph inputs: their values change no timing).
    lr, puzzle_emb_lr = config.optim.lr, config.optim.puzzle_emb_lr
    window_sums = torch.zeros(len(trainer_module.TRAIN_METRICS)).to(trainer.device)
    samples, clock = [], StepThreadsClock()
    for step in range(1, warmup + steps + 1):
        xm.wait_device_ops()  # every step starts on an idle device (see the barrier below)
        settle_ms = settle() * 1e3
        before, device_before = sharding.xla_counters(), _device_time_ns()
        clock.refresh()
        h0, p0, t0 = clock.ns(), time.process_time(), time.perf_counter()
        global_batch = prefetched.get(step)
        t2 = time.perf_counter()
        metrics = trainer.step(global_batch, lr, puzzle_emb_lr)
        window_sums = window_sums + metrics  # as the training loop sums a logging window
        c3, t3 = time.thread_time(), time.perf_counter()
        torch_xla.sync()
        c4, t4 = time.thread_time(), time.perf_counter()
        h4, p4 = clock.ns(), time.process_time()
        executions_at_return = _device_time_ns()[0]
        after = sharding.xla_counters()
        b0 = time.perf_counter()
        values = metrics.cpu().numpy()  # an output of the step: ready once the step has run on the device
        xm.wait_device_ops()
        barrier_ms = (time.perf_counter() - b0) * 1e3
        device_after = _device_time_ns()
        device_ms = (device_after[1] - device_before[1]) / 1e6
        # A CPU "device" runs on the host's cores, and sync() often sleeps while the device's
        # threads set up or run the step; on CPU the sync counts with its own CPU time. (On a
        # TPU the wall time is right: the device has its own chips and dispatch is asynchronous.)
        ran_before_barrier_ms = device_ms - barrier_ms
        sync_overlapped = executions_at_return > device_before[0] or ran_before_barrier_ms > 1.0
        sync_host_ms = ((c4 - c3) if on_cpu else (t4 - t3)) * 1e3
        samples.append({
            "host_ms": (t3 - t0) * 1e3 + sync_host_ms, "host_cpu_ms": (h4 - h0) / 1e6,
            "process_cpu_ms": (p4 - p0) * 1e3,
            "data_wait_ms": (t2 - t0) * 1e3, "data_background_ms": background[step][0],
            "data_background_cpu_ms": background[step][1], "trace_ms": (t3 - t2) * 1e3,
            "sync_ms": sync_host_ms, "sync_wall_ms": (t4 - t3) * 1e3, "sync_cpu_ms": (c4 - c3) * 1e3,
            "sync_overlapped_device": sync_overlapped, "barrier_ms": barrier_ms, "settle_ms": settle_ms,
            "device_ms": device_ms, "executions": device_after[0] - device_before[0],
            "compiles": after["compiles"] - before["compiles"],
            "transfers": after["transfers"] - before["transfers"],
            "fallbacks": sum(after["fallbacks"].values()) - sum(before["fallbacks"].values()),
            "loss": step_loss(values, batch),
        })
    prefetched.close()
    evaluation = measure_evaluation(trainer, sharding.host_batch_to_global(batches.batch(0), mesh), sharding,
                                    warmup, steps, on_cpu)
    counters_end = sharding.xla_counters()
    parameters = sum(p.numel() for p in trainer.model.parameters())
    memory = state_bytes_per_device(trainer, sharding)
    pause = measure_checkpoint(trainer, hosts, checkpoint_repeats)
    del trainer, window_sums
    timed = samples[warmup:]

    def median(key):
        return statistics.median(s[key] for s in timed)

    fallbacks = {k: v - counters_start["fallbacks"].get(k, 0) for k, v in counters_end["fallbacks"].items()
                 if v != counters_start["fallbacks"].get(k, 0)}
    return {
        "parameters": parameters,
        "host_ms_per_step": median("host_ms"),
        "host_ms_per_step_samples": [round(s["host_ms"], 3) for s in timed],
        "host_cpu_ms_per_step": median("host_cpu_ms"),
        "process_cpu_ms_per_step": median("process_cpu_ms"),
        "data_ms_per_step": median("data_wait_ms"),
        "data_background_ms_per_step": median("data_background_ms"),
        "data_background_cpu_ms_per_step": median("data_background_cpu_ms"),
        "trace_ms_per_step": median("trace_ms"),
        "sync_ms_per_step": median("sync_ms"),
        "sync_wall_ms_per_step": median("sync_wall_ms"),
        "sync_overlapped_device_steps": sum(s["sync_overlapped_device"] for s in timed),
        "device_ms_per_step": median("device_ms"),
        "device_ms_per_step_samples": [round(s["device_ms"], 3) for s in timed],
        "executions_per_step": median("executions"),
        "compiles": counters_end["compiles"] - counters_start["compiles"],
        "compile_s": counters_end["compile_seconds"] - counters_start["compile_seconds"],
        "compiles_in_timed_steps": sum(s["compiles"] for s in timed),
        "aten_fallbacks": fallbacks,
        "aten_fallbacks_per_step": sum(s["fallbacks"] for s in timed) / len(timed),
        "transfers_from_device_per_step": sum(s["transfers"] for s in timed) / len(timed),
        "loss": timed[-1]["loss"],
        "loss_samples": [s["loss"] for s in timed],
        "steps": [dict({k: round(v, 3) if isinstance(v, float) and k != "loss" else v for k, v in s.items()},
                       warmup=i < warmup)
                  for i, s in enumerate(samples)],
        **evaluation,
        **memory,
        **pause,
    }


def state_bytes_per_device(trainer, sharding) -> dict:
    """Bytes one device holds of the training state (every named_state tensor, the puzzle
    table among them) and of the ACT carries (training and evaluation), from the sharding
    annotations (sharding.bytes_per_device; nothing is copied). The carries hold this run's
    measured batch, not the preset's global batch."""
    state = trainer.named_state()
    carries = [t for carry in (trainer.carry, trainer.eval_carry) for t in carry.tensors().values()]
    table = state.get("model/puzzle_embedding.weight")
    state_bytes = sum(sharding.bytes_per_device(t) for t in state.values())
    carry_bytes = sum(sharding.bytes_per_device(t) for t in carries)
    return {"state_bytes_per_device": state_bytes + carry_bytes,
            "carry_bytes_per_device": carry_bytes,
            "puzzle_embedding_bytes_per_device": 0 if table is None else sharding.bytes_per_device(table)}


def measure_checkpoint(trainer, hosts: int, repeats: int) -> dict:
    """The training loop's pause for one checkpoint, for each host p of the slice: the wall
    time of trainer.checkpoint_shards(p, layout), the copy of host p's share of the state to its
    memory (the fastest of `repeats`, each from an idle device). That copy is what the loop's thread
    does in checkpoint.Checkpoints.save; the files are written on a background thread. Before it the
    loop waits (RunLog.drain) for the metric read of the step just run, i.e. for the device to
    finish that step: device time the step already counts, so not counted again here; the
    wait for the previous save (CheckpointWriter.save) is over long before (ckpt_every steps).

    A puzzle table split by rows (trainer.row_split) is the one part measured differently: this
    process holds every device, so it would copy every device's rows of the table to keep host
    p's, where host p of the slice copies only its own devices' rows. So the rest of host p's
    share is timed without the table, plus the copy of a row-split tensor of host p's rows of
    the table (as many bytes, from device shards, as host p copies)."""
    import torch_xla.core.xla_model as xm

    def timed(fn) -> tuple[float, object]:
        times = []
        for _ in range(repeats):
            xm.wait_device_ops()
            settle()
            started = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - started) * 1e3)
        return min(times), out

    import torch

    state = trainer.named_state()
    pauses, copied = [], []
    devices = len(trainer.sharding.device_layout().mesh_order())
    if devices % hosts:
        raise ValueError(f"the checkpoint pause of a slice of {hosts} hosts is measured on {hosts} equal groups "
                         f"of this mesh's devices; {devices} devices do not split so: use --cpu-devices "
                         f"{hosts * -(-devices // hosts)}, or a slice of fewer hosts")
    layout = trainer.sharding.DeviceLayout.contiguous(devices, hosts)  # each host: a block of devices
    for process_index in range(hosts):
        ms, shards = timed(lambda p=process_index: trainer.checkpoint_shards(p, layout, row_split=False))
        copied.append(sum(s.tensor.numel() * s.tensor.element_size() for s in shards.values()))
        del shards
        for name in trainer.row_split:  # host p's rows, as a tensor split over the devices like the table
            table = state[name]
            lo, hi = layout.row_block(table.shape[0], process_index)
            rows = trainer.sharding.rows_to_device(torch.zeros(hi - lo, *table.shape[1:], dtype=table.dtype),
                                                   trainer.mesh)
            ms += timed(lambda t=rows: trainer.sharding.local_rows(t))[0]
            copied[-1] += rows.numel() * rows.element_size()
            del rows
        pauses.append(ms)
    whole = sum(t.numel() * t.element_size() for t in state.values())
    whole += sum(t.numel() * t.element_size() for t in trainer.carry.tensors().values())
    return {"checkpoint_pause_ms": max(pauses), "checkpoint_pause_ms_per_host": [round(p, 3) for p in pauses],
            "checkpoint_bytes_per_host_max": max(copied), "checkpoint_bytes_per_host": copied,
            "checkpoint_bytes": whole, "checkpoint_hosts": hosts, "checkpoint_repeats": repeats}


def measure_evaluation(trainer, batch: dict, sharding, warmup: int, steps: int, on_cpu: bool) -> dict:
    """Run warmup + timed evaluation ACT steps as training/evaluate.py drives them (EMA weights swapped
    in, Trainer.eval_act_step then torch_xla.sync()); host time per ACT step, measured like a
    training step's (trace, plus sync's CPU time on CPU), each started on an idle device."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    sums = trainer.eval_sums()
    samples = []
    with trainer.ema.swapped_into(trainer.model):
        trainer.model.eval()
        for _ in range(warmup + steps):
            xm.wait_device_ops()
            settle()
            before = sharding.xla_counters()
            t0 = time.perf_counter()
            sums, preds, q_halt = trainer.eval_act_step(batch, sums)
            c1, t1 = time.thread_time(), time.perf_counter()
            torch_xla.sync()
            c2, t2 = time.thread_time(), time.perf_counter()
            after = sharding.xla_counters()
            sync_ms = ((c2 - c1) if on_cpu else (t2 - t1)) * 1e3
            samples.append({"trace_ms": (t1 - t0) * 1e3, "sync_ms": sync_ms,
                            "host_ms": (t1 - t0) * 1e3 + sync_ms,
                            "compiles": after["compiles"] - before["compiles"]})
        trainer.model.train()
    xm.wait_device_ops()
    del preds, q_halt, sums
    timed = samples[warmup:]
    return {
        "eval_host_ms_per_step": statistics.median(s["host_ms"] for s in timed),
        "eval_trace_ms_per_step": statistics.median(s["trace_ms"] for s in timed),
        "eval_sync_ms_per_step": statistics.median(s["sync_ms"] for s in timed),
        "eval_compiles_in_timed_steps": sum(s["compiles"] for s in timed),
    }


PAPER_RUN_COLUMNS = [  # (header, format of a record's paper_run)
    ("preset", lambda r: r["preset"]),
    ("train steps", lambda r: f"{r['paper_run']['train_steps']:,}"),
    ("ms/step", lambda r: f"{r['paper_run']['train_ms_per_step']:.2f}"),
    ("train h", lambda r: f"{r['paper_run']['train_hours']:.2f}"),
    ("evals", lambda r: f"{r['paper_run']['evaluations']}"),
    ("eval ACT steps", lambda r: f"{r['paper_run']['eval_act_steps']:,}"),
    ("eval h", lambda r: f"{r['paper_run']['eval_hours']:.2f}"),
    ("ckpts", lambda r: f"{r['paper_run']['checkpoints']}"),
    ("ckpt min", lambda r: f"{r['paper_run']['checkpoint_minutes']:.1f}"),
    ("total h", lambda r: f"{r['paper_run']['total_hours']:.2f}"),
]


# ----------------------------------------------------------------------------------------------
# Records and the table


def bench_preset(preset: str, args: BenchConfig, spec: SliceSpec, sharding, device_kind: str) -> dict:
    config = bench_config(preset, args)
    num_devices, _ = sharding.device_counts()
    batch = args.batch or num_devices
    check_batch_layout(batch, num_devices, sharding.process_count())
    with tempfile.TemporaryDirectory(prefix=f"trm-bench-{preset}-") as root:
        table_rows = args.table_rows or PAPER_DATASETS[preset].puzzle_identifiers
        write_synthetic_dataset(root, preset, config.model, table_rows)
        dataset = data.open_dataset(root, "train")
        config = check_against_dataset(config, dataset.metadata)
        record = flop_record(preset, config, spec)
        measured = dataclasses.replace(config, optim=dataclasses.replace(config.optim, global_batch_size=batch))
        record.update({"device_kind": device_kind, "devices": num_devices, "measured_batch": batch,
                       "warmup_steps": args.warmup, "timed_steps": args.steps,
                       "puzzle_embedding_rows": config.model.num_puzzle_identifiers})
        record.update(measure_training(measured, dataset, sharding, batch, args.warmup, args.steps,
                                       on_cpu=device_kind == "CPU", hosts=spec.hosts,
                                       checkpoint_repeats=args.checkpoint_repeats))
        rate = data_rows_per_s(dataset, config.optim.global_batch_size, spec.hosts, args.data_batches)
        del dataset
    record["data_rows_per_s_per_host"] = rate
    record["data_ms_per_global_step_per_host"] = config.optim.global_batch_size / spec.hosts / rate * 1e3
    projected = record["projected_device_ms_per_train_step"]
    record["host_to_projected_device_ratio"] = record["host_ms_per_step"] / projected
    record["host_cpu_to_projected_device_ratio"] = record["host_cpu_ms_per_step"] / projected
    return record


COLUMNS = [  # (header, format of a record)
    ("preset", lambda r: r["preset"]),
    ("params", lambda r: f"{r['parameters']:,}"),
    ("GF/ex train", lambda r: f"{r['train_gflop_per_example']:.2f}"),
    ("GF/ex eval", lambda r: f"{r['eval_gflop_per_example']:.2f}"),
    ("dev@peak ms", lambda r: f"{r['projected_device_ms_per_train_step']:.2f}"),
    ("host ms", lambda r: f"{r['host_ms_per_step']:.1f}"),
    ("cpu ms", lambda r: f"{r['host_cpu_ms_per_step']:.1f}"),
    ("data ms", lambda r: f"{r['data_ms_per_step']:.1f}"),
    ("bg data ms", lambda r: f"{r['data_background_ms_per_step']:.1f}"),
    ("trace ms", lambda r: f"{r['trace_ms_per_step']:.1f}"),
    ("sync ms", lambda r: f"{r['sync_ms_per_step']:.1f}"),
    ("dev ms", lambda r: f"{r['device_ms_per_step']:.0f}"),
    ("eval host ms", lambda r: f"{r['eval_host_ms_per_step']:.1f}"),
    ("ckpt ms", lambda r: f"{r['checkpoint_pause_ms']:.0f}"),
    ("ckpt MB/host", lambda r: f"{r['checkpoint_bytes_per_host_max'] / 1e6:,.1f}"),
    ("ckpt MB", lambda r: f"{r['checkpoint_bytes'] / 1e6:,.1f}"),
    ("MB/device", lambda r: f"{r['state_bytes_per_device'] / 1e6:,.1f}"),
    ("table MB/device", lambda r: f"{r['puzzle_embedding_bytes_per_device'] / 1e6:,.1f}"),
    ("compiles", lambda r: f"{r['compiles']} ({r['compile_s']:.0f}s)"),
    ("fallbacks", lambda r: f"{r['aten_fallbacks_per_step']:g}"),
    ("D2H", lambda r: f"{r['transfers_from_device_per_step']:g}"),
    ("rows/s/host", lambda r: f"{r['data_rows_per_s_per_host']:,.0f}"),
    ("host/peak", lambda r: f"{r['host_to_projected_device_ratio']:.1f}"),
    ("cpu/peak", lambda r: f"{r['host_cpu_to_projected_device_ratio']:.1f}"),
    ("loss", lambda r: f"{r['loss']:.4f}"),
]


def format_table(records: list[dict], all_columns: list = COLUMNS) -> str:
    def cell(column, record):
        try:
            return column[1](record)
        except KeyError:
            return None

    columns = [c for c in all_columns if any(cell(c, r) is not None for r in records)]
    rows = [[c[0] for c in columns]] + [[cell(c, r) or "-" for c in columns] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


class NonFiniteLoss(ValueError):
    pass


def compiled_device_time(preset: str, args: BenchConfig) -> dict:
    """The preset's steps at its global batch, compiled for args.slice (tpu_compile.py; cached)."""
    config = compiled_programs.resolved_config(bench_config(preset, args), preset, args.table_rows)
    return run_costs.device_time_fields(compiled_programs.compile_isolated([(preset, config, args.slice)])[0])


def check_losses(records: list[dict]) -> None:
    """NonFiniteLoss naming each preset and the first step (warmup steps counted) whose
    training loss is NaN or infinite."""
    problems = []
    for record in records:
        for number, step in enumerate(record.get("steps", []), start=1):
            if not math.isfinite(step["loss"]):
                problems.append(f"{record['preset']} at step {number} of {len(record['steps'])} "
                                f"({record['warmup_steps']} warmup): loss {step['loss']}")
                break
    if problems:
        raise NonFiniteLoss("the training loss is not finite: " + "; ".join(problems))


def check_args(args: BenchConfig) -> SliceSpec:
    """The slice of the projection; ValueError for flags that cannot work."""
    if args.steps < 1 or args.warmup < 1:
        raise ValueError("--steps and --warmup must be at least 1 (the first step compiles)")
    if args.batch is not None and args.batch < 1:
        raise ValueError(f"--batch must be positive, got {args.batch}")
    if args.table_rows is not None and args.table_rows < 1:
        raise ValueError(f"--table-rows must be positive, got {args.table_rows}")
    if args.checkpoint_repeats < 1:
        raise ValueError(f"--checkpoint-repeats must be at least 1, got {args.checkpoint_repeats}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    return slice_spec(args.slice)


def run(args: BenchConfig) -> dict:
    """Measure (or only count, with flops_only) every preset; returns the JSON document."""
    spec = check_args(args)
    say = print
    if args.flops_only:
        records, device_kind, num_devices = [], None, None
        for preset in args.presets:
            config = bench_config(preset, args)
            record = flop_record(preset, config, spec)
            record["parameters"] = sum(p.numel() for p in TRM(config.model).parameters())
            records.append(record)
    else:
        import sharding

        device_kind = sharding.start_runtime(args.device, args.cpu_devices)
        num_devices, _ = sharding.device_counts()
        if not sharding.is_main_process():
            say = lambda *a, **k: None  # noqa: E731
        say(f"measuring on {num_devices} {device_kind} device(s); projecting to {spec.name} "
            f"({spec.chips} chips x {spec.peak_tflops_per_chip:g} TFLOP/s)", flush=True)
        records = []
        for preset in args.presets:
            started = time.time()
            records.append(bench_preset(preset, args, spec, sharding, device_kind))
            say(f"  {preset}: {time.time() - started:.0f}s", flush=True)
    for record in records:
        if args.device_time == "compiled":
            record.update(compiled_device_time(record["preset"], args))
        record["paper_run"] = project_paper_run(record, bench_config(record["preset"], args),
                                                PAPER_DATASETS[record["preset"]], args.mfu)
    result = {"slice": spec.name, "slice_chips": spec.chips, "slice_hosts": spec.hosts, "mfu": args.mfu,
              "peak_tflops_per_chip": spec.peak_tflops_per_chip, "peak_tflops": spec.peak_tflops,
              "device_kind": device_kind, "devices": num_devices, "tiny": args.tiny,
              "capture_step": args.capture_step, "records": records}
    say(f"\nslice {spec.name}: {spec.chips} chips, peak {spec.peak_tflops:,.0f} TFLOP/s bf16; "
        f"measured on {num_devices or 0} {device_kind or 'no'} device(s)"
        + ("" if args.flops_only else f", {'captured' if args.capture_step else 're-traced'} step"))
    say(format_table(records))
    device = (f" from its programs compiled for it: each step takes the longer of host ms and the compiler's "
              f"estimate ({records[0].get('compiled_source', '')})" if args.device_time == "compiled" and records
              else f" at {args.mfu:.0%} MFU: each step takes the longer of host ms and dev@peak ms / {args.mfu:g}")
    say(f"\nthe paper's recipe on {spec.name}{device}"
        + (" (device only: --flops-only measures no host time)" if args.flops_only else "")
        + "; evaluations of halt_max_steps ACT steps per batch of the test split (eval.max_examples caps all "
          "but the last); checkpoint pauses of ckpt ms; real dataset sizes (bench.PAPER_DATASETS)")
    say(format_table(records, PAPER_RUN_COLUMNS))
    if args.json and say is print:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        say(f"wrote {args.json}")
    check_losses(records)  # after the table and the JSON, which show every step's loss
    return result


def main(argv: list[str] | None = None) -> dict:
    bench_args = tyro.cli(BenchConfig, args=argv, description=__doc__.split("\n\n")[0])
    try:
        check_args(bench_args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    try:
        return run(bench_args)
    except (ConfigError, NonFiniteLoss, compiled_programs.CompileError) as e:  # ConfigError: a --batch not dividing
        compile_failed = isinstance(e, compiled_programs.CompileError)
        hint = "; or at a stated MFU: --device-time mfu --mfu 0.4" if compile_failed else ""
        raise SystemExit(f"error: {e}{hint}")


if __name__ == "__main__":
    main()
