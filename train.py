"""Train a Tiny Recursive Model (TRM) on a Cloud TPU slice or on a virtual CPU mesh.

Every host of a slice runs this same command; one program spans all devices (PyTorch/XLA SPMD,
data parallel). On a laptop:

    python train.py demo                 # builds data/demo if missing, trains on 8 virtual CPU devices

With a dataset in the reference format (local path or gs://), a preset and any overrides:

    python train.py sudoku-mlp --data.path gs://BUCKET/data/sudoku-extreme-1k-aug-1000 \\
        --run.dir gs://BUCKET/runs/sudoku-mlp-1
    python train.py arc1 --optim.lr 3e-4 --data.path gs://BUCKET/data/arc1 --run.dir gs://BUCKET/runs/x
    python train.py --help               # the presets
    python train.py arc1 --help          # every setting, with its preset value

Relaunching the same command continues from the run directory's latest checkpoint; SIGTERM
(a spot VM's preemption notice) saves one and exits 0. Other commands:

    python train.py export gs://BUCKET/runs/NAME --out gs://BUCKET/models/NAME.safetensors
    python train.py eval --init-from gs://BUCKET/runs/NAME --data.path gs://BUCKET/data/...
    python train.py eval arc1 --init-from reference_step_123.pt --data.path gs://BUCKET/data/arc1

Presets: sudoku-mlp, sudoku-att, maze, arc1, arc2 (the paper's recipes) and demo. On a pod,
`bash launch.sh train RUN_NAME PRESET ...` runs this on every host with PJRT_DEVICE=TPU.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import tyro

import data
from arc import REFERENCE_PASS_KS, VOTES_FILE, ArcEvaluator, decode_summary, encode_summary, write_submission
from checkpoint import CheckpointWriter
from model import TRM, TRMConfig
from trainer import EVAL_METRICS, TRAIN_METRICS, Trainer

PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------
# Configuration


@dataclass
class DataConfig:
    path: str = "data/sudoku-extreme-1k-aug-1000"
    """Dataset root in the reference's format: a local path or an fsspec URL (gs://...)."""
    cache_dir: Optional[str] = None
    """Local directory for the cached arrays (default ~/.cache/trm-data/<hash of path>)."""


@dataclass
class OptimConfig:
    global_batch_size: int = 768
    """Examples per step over all hosts (the paper's 768); must divide by the device count."""
    epochs: int = 50000
    """Training length in epochs (an epoch draws one puzzle per group)."""
    max_steps: Optional[int] = None
    """Stop after this many steps instead (for quick runs); None trains for `epochs`."""
    lr: float = 1e-4
    """Peak learning rate of AdamATan2."""
    lr_min_ratio: float = 1.0
    """Cosine decay floor as a fraction of lr (1.0: constant after warmup, as in the paper)."""
    lr_warmup_steps: int = 2000
    """Linear warmup steps from 0."""
    beta1: float = 0.9
    """AdamATan2 beta1."""
    beta2: float = 0.95
    """AdamATan2 beta2."""
    weight_decay: float = 1.0
    """Decoupled weight decay of AdamATan2."""
    puzzle_emb_lr: float = 1e-4
    """Peak learning rate of the puzzle-embedding SignSGD (same schedule)."""
    puzzle_emb_weight_decay: float = 1.0
    """Decoupled weight decay of the puzzle embedding."""
    ema_rate: float = 0.999
    """EMA rate of the weights used for evaluation and export."""


@dataclass
class EvalConfig:
    every_epochs: int = 5000
    """Evaluate every this many epochs, counted in epochs as the reference does; the final
    evaluation at the last step takes the place of the one due at the end."""
    max_examples: Optional[int] = None
    """Cap intermediate evaluations to a fixed seeded subset of this many test examples
    (the final evaluation uses all); None evaluates everything every time."""
    arc: bool = False
    """Score ARC pass@1/2/5/10/100/1000 by voting over augmentations and write submission.json
    (needs the ARC builder's identifiers.json and test_puzzles.json; on in the arc presets)."""
    arc_aggregate: bool = False
    """Also vote over every evaluation of this run so far (aggregated_pass@k, and the submission),
    as the reference reports ARC scores; `train.py eval` votes over its own and the saved votes
    of earlier steps in {run.dir}/eval/step_N/arc_votes.json.gz. Needs --eval.arc."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    """Run directory (local or gs://): config, checkpoints, TensorBoard logs."""
    seed: int = 0
    """Seed of the initial weights, the data order and the halting exploration."""
    device: Literal["auto", "tpu", "cpu"] = "auto"
    """auto (TPU if attached or PJRT_DEVICE says so), tpu (fail without one), cpu (virtual mesh)."""
    cpu_devices: int = 8
    """Virtual devices of the CPU mesh (device cpu)."""
    log_every: int = 100
    """Read metrics back and print a progress line every this many steps."""
    ckpt_every: int = 2000
    """Save a checkpoint every this many steps (and always at the end and on SIGTERM)."""
    keep_checkpoints: int = 3
    """Committed checkpoints to keep; older ones are deleted."""
    init_from: Optional[str] = None
    """Start from these weights (a reference-implementation checkpoint or an exported
    model.safetensors) when the run directory has no checkpoint yet."""
    allow_config_change: bool = False
    """Resume even though the run directory was created with a different configuration."""
    preempt_check_every: int = 10
    """On several hosts, agree every this many steps whether any host got SIGTERM."""
    compile_cache_dir: str = "~/.cache/trm-xla"
    """Persistent XLA compilation cache on each TPU host, so a relaunch does not recompile."""
    capture_step: bool = True
    """Trace the training step once and replay it as one XLA computation (a few ms of host time
    per step instead of re-tracing ~50-150 ms of Python); False re-traces every step."""
    profile_steps: int = 0
    """Capture an XLA profile of this many steps (from the 10th step of this launch) into
    {run.dir}/tb/plugins/profile for TensorBoard's profile tab; 0 = off."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: TRMConfig = field(default_factory=lambda: TRMConfig(mlp_t=True, pos_encodings="none"))
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _preset(base: Config | None = None, **sections) -> Config:
    config = base or Config()
    for name, overrides in sections.items():
        config = dataclasses.replace(config, **{name: dataclasses.replace(getattr(config, name), **overrides)})
    return config


_arc = _preset(
    data=dict(path="data/arc1concept-aug-1000"),
    model=dict(seq_len=900, vocab_size=12, mlp_t=False, pos_encodings="rope", L_cycles=4),
    optim=dict(epochs=100000, puzzle_emb_lr=1e-2, weight_decay=0.1, puzzle_emb_weight_decay=0.1),
    eval=dict(every_epochs=10000, arc=True, arc_aggregate=True),
)
PRESETS: dict[str, tuple[str, Config]] = {
    "sudoku-mlp": ("Sudoku-Extreme, TRM-MLP (paper: 87.4% exact)", Config()),
    "sudoku-att": ("Sudoku-Extreme, attention TRM (paper: 74.7%)",
                   _preset(model=dict(mlp_t=False, pos_encodings="rope"))),
    "maze": ("Maze-Hard 30x30, attention TRM (paper: 85.3%)",
             _preset(data=dict(path="data/maze-30x30-hard-1k"),
                     model=dict(seq_len=900, vocab_size=6, mlp_t=False, pos_encodings="rope", L_cycles=4))),
    "arc1": ("ARC-AGI-1, attention TRM (paper: 44.6% pass@2)", _arc),
    "arc2": ("ARC-AGI-2, attention TRM (paper: 7.8% pass@2)",
             _preset(_arc, data=dict(path="data/arc2concept-aug-1000"))),
    "demo": ("4x4 Sudoku built locally, a tiny TRM on the CPU mesh in minutes",
             _preset(data=dict(path="data/demo"),
                     model=dict(seq_len=16, vocab_size=6, hidden_size=64, num_heads=4, expansion=2.0,
                                H_cycles=2, L_cycles=2, puzzle_emb_ndim=64, puzzle_emb_len=1,
                                halt_max_steps=4, forward_dtype="float32"),
                     optim=dict(global_batch_size=128, epochs=200, lr=1e-3, puzzle_emb_lr=1e-2,
                                lr_warmup_steps=50, weight_decay=0.1, puzzle_emb_weight_decay=0.1,
                                ema_rate=0.99),
                     eval=dict(every_epochs=50, max_examples=512),
                     run=dict(dir="runs/demo", device="cpu", log_every=20))),
}


class ConfigError(ValueError):
    pass


def check_against_dataset(config: Config, metadata: data.Metadata) -> Config:
    """The model's data-derived fields must match the dataset; returns the config with the
    dataset's identifier count filled in."""
    for name in ("seq_len", "vocab_size"):
        ours, theirs = getattr(config.model, name), getattr(metadata, name)
        if ours != theirs:
            raise ConfigError(
                f"model.{name}={ours} but the dataset at {config.data.path} has {name}={theirs}: "
                f"pass --model.{name.replace('_', '-')} {theirs} or the preset made for this dataset")
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, num_puzzle_identifiers=metadata.num_puzzle_identifiers))


def check_batch_layout(global_batch_size: int, num_devices: int, num_hosts: int) -> None:
    if global_batch_size % num_devices:
        raise ConfigError(
            f"optim.global_batch_size={global_batch_size} does not divide over the {num_devices} devices "
            f"of this slice; use a multiple of {num_devices} (e.g. {math.ceil(global_batch_size / num_devices) * num_devices})")
    if global_batch_size % num_hosts:
        raise ConfigError(f"optim.global_batch_size={global_batch_size} does not divide over {num_hosts} hosts")


def lr_at(step: int, peak: float, optim: OptimConfig, total_steps: int) -> float:
    """The reference schedule: linear warmup from 0, then cosine down to lr_min_ratio·peak.

    `step` counts updates from 1 (the reference increments its counter before the update).
    """
    if step < optim.lr_warmup_steps:
        return peak * step / max(1, optim.lr_warmup_steps)
    progress = (step - optim.lr_warmup_steps) / max(1, total_steps - optim.lr_warmup_steps)
    floor = optim.lr_min_ratio
    return peak * (floor + max(0.0, (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))))


def evaluation_steps(full_steps: int, epochs: int, every_epochs: int, last_step: int) -> list[int]:
    """The steps after which a run evaluates, scheduled as the reference does: after every
    `every_epochs` epochs (the k-th at the step nearest k·every_epochs·full_steps/epochs, counted
    in epochs so that rounding does not drift), and at `last_step`, whose final evaluation takes
    the place of the one due when the `epochs` end. `full_steps` trains all `epochs`; a run cut
    short (last_step < full_steps) keeps the scheduled evaluations before its last step."""
    if every_epochs < 1:
        raise ConfigError(f"eval.every_epochs={every_epochs} must be at least 1 (the final evaluation "
                          f"always runs; use --eval.every-epochs {epochs} for only that one)")
    # Nearest step, halves up, in integers: exact for any run length.
    scheduled = {(2 * k * every_epochs * full_steps + epochs) // (2 * epochs)
                 for k in range(1, -(-epochs // every_epochs))}
    return sorted(step for step in scheduled if 1 <= step < last_step) + [last_step]


def config_fingerprint(config: Config) -> str:
    """Text that differs whenever the flags or the code differ (compared across hosts)."""
    sources = []
    for name in ("train.py", "model.py", "data.py", "sharding.py"):
        with open(os.path.join(PROJECT_DIR, name), "rb") as f:
            sources.append(f"{name}:{hashlib.sha256(f.read()).hexdigest()}")
    return json.dumps(dataclasses.asdict(config), sort_keys=True) + "\n" + "\n".join(sources)


class PrefetchedBatches:
    """The global batch of each training step, read and uploaded to the devices on a background
    thread while the step before it runs (as torch_xla's MpDeviceLoader does), so the loop only
    waits for data when reading is slower than a step. Batches depend only on the step, so
    prefetching changes no result."""

    def __init__(self, load, first_step: int, last_step: int):
        self.load, self.last_step = load, last_step
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trm-batches")
        self.pending = {first_step: self.thread.submit(load, first_step)} if first_step <= last_step else {}

    def get(self, step: int) -> dict[str, torch.Tensor]:
        future = self.pending.pop(step, None) or self.thread.submit(self.load, step)
        batch = future.result()  # raises here if reading or uploading failed
        if step < self.last_step:
            self.pending[step + 1] = self.thread.submit(self.load, step + 1)
        return batch

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# Reporting


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def summarize(names, values: np.ndarray, steps: int, global_batch_size: int) -> dict[str, float]:
    """Sums over a window of steps → the reference's normalisation: losses per example, the
    rest per halted (counted) example."""
    sums = dict(zip(names, values.tolist()))
    count = max(sums["count"], 1.0)
    return {k: v if k == "count" else v / (global_batch_size * steps if k.endswith("loss") else count)
            for k, v in sums.items()}


def xla_counters() -> dict:
    """Graphs compiled (and seconds), aten:: CPU fallbacks by op, device-to-host transfers."""
    import torch_xla.debug.metrics as met

    compile_data = met.metric_data("CompileTime")
    transfers = met.metric_data("TransferFromDeviceTime")
    return {
        "compiles": compile_data[0] if compile_data else 0,
        "compile_seconds": compile_data[1] / 1e9 if compile_data else 0.0,
        "fallbacks": {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")},
        "transfers": transfers[0] if transfers else 0,
    }


# ----------------------------------------------------------------------------------------------
# Main


class RunLog:
    """Progress lines (process 0), TensorBoard scalars under {run_dir}/tb (process 0) and the
    returned history. Device values are read on one background thread, in order, so the step
    loop never waits for them."""

    def __init__(self, config: Config, total_steps: int, main_host: bool):
        self.config, self.total_steps, self.main_host = config, total_steps, main_host
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.nonfinite: str | None = None  # the first window whose loss or metrics were NaN/inf
        self.reader = ThreadPoolExecutor(max_workers=1)
        self.tb = None
        if main_host:
            from torch.utils.tensorboard import SummaryWriter

            # Event files grow by appending, which object stores cannot do (gcsfs silently
            # overwrites): write them locally and upload whole copies after each write.
            self.tb_remote = data.join_url(config.run.dir, "tb")
            self.tb_local = self.tb_remote if "://" not in config.run.dir else tempfile.mkdtemp(prefix="trm-tb-")
            self.tb = SummaryWriter(self.tb_local)

    def say(self, *parts) -> None:
        if self.main_host:
            print(*parts, flush=True)

    def _in_order(self, fn, *args) -> None:
        self.reader.submit(fn, *args).add_done_callback(_raise_in_main_thread)

    def config_text(self, config: Config) -> None:
        if self.tb:
            text = json.dumps(dataclasses.asdict(config), indent=2)
            self._in_order(self.tb.add_text, "config", f"```\n{text}\n```", 0)

    def train_window(self, sums: torch.Tensor, step: int, steps: int, seconds: float, lr: float) -> None:
        self._in_order(self._report_train, sums, step, steps, seconds, lr)

    def _report_train(self, sums, step, steps, seconds, lr):
        o = self.config.optim
        m = summarize(TRAIN_METRICS, sums.cpu().numpy(), steps, o.global_batch_size)
        rate = steps / max(seconds, 1e-9)
        m.update(step=step, lr=lr, loss=m["lm_loss"] + 0.5 * m["q_halt_loss"], steps_per_s=rate,
                 examples_per_s=rate * o.global_batch_size)
        self.history.append(m)
        bad = sorted((k for k, v in m.items() if not math.isfinite(v)), key=lambda k: k != "loss")
        if bad and self.nonfinite is None:
            self.nonfinite = f"steps {step - steps + 1}-{step}: " + ", ".join(f"{k} {m[k]}" for k in bad)
        self.say(f"step {step}/{self.total_steps} ({100 * step / self.total_steps:.1f}%)  loss {m['loss']:.4f}  "
                 f"exact {m['exact_accuracy']:.3f}  lr {lr:.2e}  {rate:.2f} steps/s  "
                 f"{m['examples_per_s']:.0f} ex/s  ETA {format_duration((self.total_steps - step) / rate)}")
        if self.tb:
            for k, v in m.items():
                if k != "step":
                    self.tb.add_scalar(f"train/{k}", v, step)
            self.tb.add_scalar("xla/compiles", xla_counters()["compiles"], step)
            self._upload_tb()

    def _upload_tb(self) -> None:
        self.tb.flush()
        if self.tb_local != self.tb_remote:
            import checkpoint

            for name in os.listdir(self.tb_local):
                with open(os.path.join(self.tb_local, name), "rb") as f:
                    checkpoint.write_bytes(data.join_url(self.tb_remote, name), f.read())

    def evaluation(self, result: dict[str, float], step: int, seconds: float) -> None:
        self.evals.append(dict(result, step=step))
        arc = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith(("pass@", "aggregated_pass@")))
        if "aggregated_evaluations" in result:
            count = result["aggregated_evaluations"]
            arc += f" (aggregated over {count} evaluation{'s' if count != 1 else ''})"
        self.say(f"eval @ step {step}: exact_accuracy {result['exact_accuracy']:.4f}  "
                 f"accuracy {result['accuracy']:.4f}  q_halt_accuracy {result['q_halt_accuracy']:.4f}  "
                 f"steps {result['steps']:.2f}  lm_loss {result['lm_loss']:.4f}  "
                 f"q_halt_loss {result['q_halt_loss']:.4f}  {arc + '  ' if arc else ''}"
                 f"on {result['num_examples']} examples in {seconds:.0f}s")
        if self.tb:
            for k, v in result.items():
                self._in_order(self.tb.add_scalar, f"eval/{k}", v, step)
            self._in_order(self._upload_tb)

    def drain(self) -> None:
        """Wait until every queued read has finished."""
        self.reader.submit(lambda: None).result()

    def close(self) -> None:
        self.reader.shutdown(wait=True)
        if self.tb:
            self._upload_tb()
            self.tb.close()


OPERATIONAL_FIELDS = {"data.cache_dir", "eval.arc_aggregate", "run.log_every", "run.device", "run.cpu_devices", "run.ckpt_every",
                      "run.keep_checkpoints", "run.init_from", "run.allow_config_change",
                      "run.preempt_check_every", "optim.max_steps"}


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Fields (dotted) whose values differ, leaving out those that do not change the math."""
    out = []
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, name + ".")
        elif a != b and name not in OPERATIONAL_FIELDS:
            out.append(f"{name}: {a!r} in the run directory, {b!r} now")
    return out


def read_reference_checkpoint(url: str) -> dict[str, torch.Tensor]:
    """The state dict of a reference-implementation checkpoint (a torch.save file)."""
    import io

    import checkpoint

    return torch.load(io.BytesIO(checkpoint.read_bytes(url)), map_location="cpu", weights_only=True)


def load_initial_weights(url: str, model_config: TRMConfig, dataset_identifiers: str | None = None,
                         resize_puzzle_table: bool = True) -> dict[str, torch.Tensor]:
    """`model/*` tensors from an exported model.safetensors or a reference checkpoint.

    An exported model trained on a dataset whose identifiers differ from `dataset_identifiers`
    (data.identifiers_fingerprint) is refused: its table rows belong to other puzzles."""
    import checkpoint
    from model import load_reference_state_dict

    model = TRM(model_config)
    if url.endswith(".safetensors"):
        weights, _, trained_on = checkpoint.read_exported(url)
        check_same_identifiers(trained_on, dataset_identifiers, url)
        model.load_state_dict(weights)
    else:
        load_reference_state_dict(model, read_reference_checkpoint(url), resize_puzzle_table)
    return {f"model/{k}": v for k, v in model.state_dict().items()}


def check_same_identifiers(trained_on: str | None, dataset: str | None, weights_url: str) -> None:
    """Refuse weights whose puzzle-embedding rows were trained for other identifiers (both
    fingerprints known and different)."""
    if trained_on and dataset and trained_on != dataset:
        raise ConfigError(
            f"{weights_url} was trained on a dataset with other puzzle identifiers (fingerprint "
            f"{trained_on}) than the one given (fingerprint {dataset}): row i of its puzzle-embedding "
            "table belongs to another puzzle there. Use the dataset the model was trained on, or "
            "rebuild it with the same builder, source files and seed")


def evaluate(trainer: Trainer, batches: data.EvalBatches, sync, arc=None, say=lambda *a: None,
             eval_root: str | None = None, step: int = 0, aggregate: bool = False):
    """Exactly halt_max_steps ACT steps per batch with the EMA weights; the reference's
    metrics over real (non-padding) examples, plus ARC pass@k when `arc` (an ArcEvaluator)
    is given. Returns (metrics, ARC submission or None).

    With `arc` and `eval_root`, process 0 saves this evaluation's votes to
    {eval_root}/step_{step}/arc_votes.json.gz; with `aggregate` too, aggregated_pass@k (and the
    submission) are a vote over them and the saved votes of every earlier step."""
    sharding = trainer.sharding
    sums = torch.zeros(len(EVAL_METRICS)).to(trainer.device)
    started, report_every = time.time(), max(1, len(batches) // 10)
    if arc is not None:
        arc.begin()
    with trainer.ema.swapped_into(trainer.model):
        trainer.model.eval()
        for index in range(len(batches)):
            host_batch = batches.batch(index)
            batch = sharding.host_batch_to_global(host_batch, trainer.mesh)
            for _ in range(trainer.config.model.halt_max_steps):
                # preds and q_halt stay referenced across the sync, so every ACT step is the
                # same graph whether or not this batch's predictions are read.
                metrics, preds, q_halt = trainer.eval_step(batch)
                sums = sums + metrics
                sync()
            if arc is not None:  # this host's rows only: votes are summarised before crossing hosts
                arc.update(host_batch, sharding.local_rows(preds)[1].numpy(),
                           sharding.local_rows(q_halt)[1].float().numpy(), batches.valid(index))
            done = index + 1
            if done % report_every == 0 and done < len(batches):
                elapsed = time.time() - started
                say(f"  eval batch {done}/{len(batches)} ({100 * done / len(batches):.0f}%), "
                    f"ETA {format_duration(elapsed / done * (len(batches) - done))}")
        trainer.model.train()
    # The reference's evaluate divides every sum, the losses included, by count.
    sums = dict(zip(EVAL_METRICS, sums.cpu().numpy().tolist()))
    result = {k: v if k == "count" else v / max(sums["count"], 1.0) for k, v in sums.items()}
    result["num_examples"] = batches.num_examples
    submission = None
    if arc is not None:
        votes = arc.merge(sharding.all_gather_object(arc.summary()))
        result.update(arc.result(votes, REFERENCE_PASS_KS))
        if eval_root is not None and sharding.is_main_process():
            save_arc_votes(eval_root, step, votes)
        if aggregate:
            if eval_root is None:
                raise ValueError("evaluate: aggregate needs eval_root, where the earlier votes are saved")
            earlier = [v for _, v in saved_arc_votes(eval_root, before_step=step)]
            votes = arc.merge([votes, *earlier])
            result.update({f"aggregated_{k}": v for k, v in arc.result(votes, REFERENCE_PASS_KS).items()})
            result["aggregated_evaluations"] = 1 + len(earlier)
        submission = arc.submission(votes)
    return result, submission


def save_arc_votes(eval_root: str, step: int, votes: dict) -> str:
    """Write an evaluation's merged ARC votes to {eval_root}/step_{step}/arc_votes.json.gz."""
    import checkpoint

    url = data.join_url(eval_root, f"step_{step}", VOTES_FILE)
    checkpoint.write_bytes(url, encode_summary(votes))
    return url


def saved_arc_votes(eval_root: str, before_step: int) -> list[tuple[int, dict]]:
    """(step, votes) of every evaluation saved under eval_root at a step before `before_step`,
    oldest first. Later steps are left out: after a resume they belong to the interrupted
    launch and are evaluated (and overwritten) again."""
    import checkpoint

    fs, path = data.filesystem(eval_root)
    fs.invalidate_cache(path)
    pattern = re.compile(r"step_(\d+)/" + re.escape(VOTES_FILE) + "$")
    found = checkpoint.with_retries("listing", eval_root, lambda: fs.glob(f"{path.rstrip('/')}/step_*/{VOTES_FILE}"))
    steps = sorted({int(m.group(1)) for m in map(pattern.search, found) if m and int(m.group(1)) < before_step})
    urls = [data.join_url(eval_root, f"step_{s}", VOTES_FILE) for s in steps]
    return [(s, decode_summary(checkpoint.read_bytes(url), url)) for s, url in zip(steps, urls)]


def start(config: Config, weights_rows: int | None = None, weights_identifiers: str | None = None,
          weights_url: str = ""):
    """Everything that can be checked without a device, then the runtime and the host group.
    Returns (config with the dataset's identifier count, train set, test set, the sharding
    module, "TPU" or "CPU", the dataset's identifiers fingerprint). `weights_rows` and
    `weights_identifiers`: the rows of given weights' puzzle-embedding table and the fingerprint
    of the identifiers they were trained on, which must match the dataset's."""
    try:
        train_set, test_set = data.open_train_test(config.data.path, cache_dir=config.data.cache_dir)
        config = check_against_dataset(config, train_set.metadata)
        identifiers = data.identifiers_fingerprint(config.data.path)
        check_same_identifiers(weights_identifiers, identifiers, weights_url)
        if config.eval.arc_aggregate and not config.eval.arc:
            raise ConfigError("eval.arc_aggregate votes over ARC evaluations but eval.arc is off: "
                              "pass --eval.arc too (needs an ARC dataset)")
        if weights_rows is not None and weights_rows != train_set.metadata.num_puzzle_identifiers:
            raise ConfigError(f"the weights' puzzle embedding has {weights_rows} identifiers but the dataset at "
                              f"{config.data.path} has num_puzzle_identifiers="
                              f"{train_set.metadata.num_puzzle_identifiers}: evaluate on the dataset the model "
                              "was trained on")
    except (data.DatasetError, ConfigError) as e:
        raise SystemExit(f"error: {e}")

    import sharding

    device_kind = sharding.start_runtime(config.run.device, config.run.cpu_devices, config.run.compile_cache_dir)
    num_devices, _ = sharding.device_counts()
    try:
        check_batch_layout(config.optim.global_batch_size, num_devices, sharding.process_count())
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    sharding.init_host_group()
    sharding.check_same_config(config_fingerprint(config))
    return config, train_set, test_set, sharding, device_kind, identifiers


def main(config: Config) -> dict:
    """Train (and evaluate) as configured, resuming from the run directory's latest
    checkpoint; returns the logged history, the evaluations and the XLA counters."""
    # 1-2. Checks, then the runtime, the mesh and the hosts.
    config, train_set, test_set, sharding, device_kind, identifiers = start(config)
    import torch_xla

    import checkpoint

    num_devices, local_devices = sharding.device_counts()
    num_hosts, host = sharding.process_count(), sharding.process_index()
    o = config.optim
    full_steps = data.total_train_steps(train_set.metadata, o.epochs, o.global_batch_size)
    total_steps = full_steps if o.max_steps is None else min(full_steps, o.max_steps)
    try:
        eval_steps = evaluation_steps(full_steps, o.epochs, config.eval.every_epochs, total_steps)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    log = RunLog(config, total_steps, sharding.is_main_process())
    log.say(f"TRM on {device_kind}: {num_devices} devices on {num_hosts} host(s) ({local_devices} here); "
            f"global batch {o.global_batch_size}, {total_steps} steps, {len(eval_steps)} evaluations "
            f"(steps {', '.join(map(str, eval_steps[:3]))}{', ...' if len(eval_steps) > 4 else ''}"
            f"{', ' + str(eval_steps[-1]) if len(eval_steps) > 3 else ''})")

    # 3. Resume from the latest committed checkpoint, or start (optionally from given weights).
    def host_rows(shape):
        return host * shape[0] // num_hosts, (host + 1) * shape[0] // num_hosts

    found = checkpoint.latest_checkpoint(config.run.dir, lambda url: checkpoint.read_checkpoint(url, host_rows))
    restore, start_step = None, 0
    if found:
        start_step, url, (restore, saved) = found
        differences = config_differences(saved["config"], dataclasses.asdict(config))
        if saved.get("dataset_identifiers") not in (None, identifiers):
            differences.append(f"the dataset's puzzle identifiers: fingerprint {saved['dataset_identifiers']} "
                               f"in the run directory, {identifiers} now")
        if differences and not config.run.allow_config_change:
            raise SystemExit(f"error: {config.run.dir} was created with another configuration:\n  "
                             + "\n  ".join(differences)
                             + "\nuse the original flags, a new --run.dir, or --run.allow-config-change")
        log.say(f"resuming from {url} (step {start_step})")
    elif config.run.init_from:
        try:
            restore = load_initial_weights(config.run.init_from, config.model, identifiers)
        except ConfigError as e:
            raise SystemExit(f"error: {e}")
        log.say(f"initial weights from {config.run.init_from}")
    if sharding.is_main_process() and not found:
        checkpoint.write_bytes(data.join_url(config.run.dir, "config.json"),
                               json.dumps(dataclasses.asdict(config), indent=2).encode())
    log.config_text(config)

    mesh = sharding.data_mesh()
    trainer = Trainer(config, sharding, mesh, restore)
    del restore
    log.say(f"model: {sum(p.numel() for p in trainer.model.parameters()):,} parameters; data: {config.data.path}")
    train_batches = data.TrainBatches(train_set, o.global_batch_size, seed=config.run.seed,
                                      process_index=host, process_count=num_hosts)
    writer = CheckpointWriter(config.run.dir, host, num_hosts, keep=config.run.keep_checkpoints)

    checkpoint_transfers = []

    def stop_if_not_finite() -> None:
        """Every host has read the same metric windows after a drain, so all stop here together,
        without saving: a NaN state must never replace the last good checkpoint."""
        if log.nonfinite is None:
            return
        writer.wait()  # a save already under way holds checked steps: let it commit
        committed = checkpoint.list_checkpoints(config.run.dir)
        last = f"{committed[0][1]} (step {committed[0][0]})" if committed else "none yet"
        raise SystemExit(
            f"error: the training loss or metrics are not finite ({log.nonfinite}); stopped without "
            f"saving. Last committed checkpoint: {last}; relaunching resumes from it and will likely "
            f"diverge again. Try a lower --optim.lr (now {o.lr:g}), a longer --optim.lr-warmup-steps "
            f"(now {o.lr_warmup_steps})"
            + ("" if config.model.forward_dtype == "float32" else
               f", or --model.forward-dtype float32 (now {config.model.forward_dtype})")
            + ", with --run.allow-config-change to continue this run directory.")

    def save(step: int) -> None:
        log.drain()  # the copy waits for this step anyway; draining first keeps the counts apart
        stop_if_not_finite()
        before = xla_counters()["transfers"]
        blocks = trainer.checkpoint_shards(host, num_hosts)  # the loop pauses only for this copy
        checkpoint_transfers.append(xla_counters()["transfers"] - before)
        writer.save(step, blocks, {"step": step, "config": dataclasses.asdict(config),
                                   "dataset_identifiers": identifiers})

    arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None
    scheduled_evals = set(eval_steps[:-1])  # the final one runs after the loop
    eval_root = data.join_url(config.run.dir, "eval")

    def run_eval(step: int, final: bool) -> None:
        started = time.time()
        batches = data.EvalBatches(test_set, o.global_batch_size, process_index=host, process_count=num_hosts,
                                   max_examples=None if final else config.eval.max_examples, seed=config.run.seed)
        result, submission = evaluate(trainer, batches, torch_xla.sync, arc, log.say, eval_root, step,
                                      config.eval.arc_aggregate)
        log.evaluation(result, step, time.time() - started)
        if sharding.is_main_process():
            if submission is not None:
                log.say(f"ARC submission: {write_submission(data.join_url(eval_root, f'step_{step}'), submission)}")
            # Written last: its presence marks the evaluation of this step done (see the resume below).
            checkpoint.write_bytes(data.join_url(eval_root, f"step_{step}", "metrics.json"),
                                   json.dumps(dict(result, step=step), indent=2).encode())

    stop_requested = []
    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    check_stop_every = 1 if num_hosts == 1 else config.run.preempt_check_every
    profile = Profile(config, start_step + 10) if config.run.profile_steps and sharding.is_main_process() else None

    # 4. The loop. Nothing in it reads a device value: metric sums are read by a background
    # thread every log_every steps, while the host traces the following steps.
    trainer.init_carries(sharding.host_batch_to_global(train_batches.batch(start_step), mesh))
    torch_xla.sync()  # materialise weights, optimizer state and carries before the first step
    if found and start_step in scheduled_evals and not checkpoint.exists(
            data.join_url(eval_root, f"step_{start_step}", "metrics.json")):
        # A SIGTERM at an evaluation step saves and stops before evaluating: evaluate the saved
        # weights now, so the run (and its ARC vote over evaluations) misses no evaluation.
        run_eval(start_step, final=False)
    window_sums = torch.zeros(len(TRAIN_METRICS)).to(trainer.device)
    window_start, window_steps, loop_start = time.time(), 0, time.time()
    preempted = False
    batches = PrefetchedBatches(lambda step: sharding.host_batch_to_global(train_batches.batch(step - 1), mesh),
                                start_step + 1, total_steps)
    for step in range(start_step + 1, total_steps + 1):
        batch = batches.get(step)
        lr = lr_at(step, o.lr, o, total_steps)
        if profile:
            profile.before_step(step)
        window_sums = window_sums + trainer.step(batch, lr, lr_at(step, o.puzzle_emb_lr, o, total_steps))
        torch_xla.sync()
        window_steps += 1
        if profile:
            profile.after_step(step, log.say)
        # Hosts agree whether any of them got SIGTERM or read a non-finite window (save() stops then).
        stop = step % check_stop_every == 0 and sharding.any_host(bool(stop_requested) or log.nonfinite is not None)
        # A window also ends at every save, so that each saved step has had its loss checked.
        if stop or step % config.run.log_every == 0 or step % config.run.ckpt_every == 0 or step == total_steps:
            log.train_window(window_sums, step, window_steps, time.time() - window_start, lr)
            window_sums = torch.zeros(len(TRAIN_METRICS)).to(trainer.device)
            window_start, window_steps = time.time(), 0
        if stop:
            save(step)
            writer.wait()
            log.say(f"SIGTERM: saved checkpoint {checkpoint.step_dir(config.run.dir, step)}; "
                    "run the same command again to resume")
            preempted = True
            break
        if step % config.run.ckpt_every == 0 and step != total_steps:
            save(step)
        if step in scheduled_evals:
            run_eval(step, final=False)
    batches.close()

    if not preempted:
        if total_steps > start_step or not found:
            save(total_steps)
        run_eval(total_steps, final=True)
        writer.wait()
        log.say(f"done: {total_steps} steps in {format_duration(time.time() - loop_start)}; final exact accuracy "
                f"{100 * log.evals[-1]['exact_accuracy']:.2f}% on held-out puzzles")
    log.close()
    signal.signal(signal.SIGTERM, previous_sigterm)
    xla = xla_counters()
    log.say(f"XLA: {xla['compiles']} graphs compiled ({xla['compile_seconds']:.1f}s), "
            f"{sum(xla['fallbacks'].values())} aten:: CPU fallbacks{' ' + str(xla['fallbacks']) if xla['fallbacks'] else ''}, "
            f"{xla['transfers']} device-to-host transfers")
    return {"history": log.history, "evals": log.evals, "final": log.evals[-1] if log.evals else None,
            "xla": xla, "checkpoint_transfers": sum(checkpoint_transfers), "preempted": preempted,
            "start_step": start_step}


class Profile:
    """An XLA profile of run.profile_steps steps, written locally then copied to
    {run_dir}/tb/plugins/profile (object stores cannot take the profiler's writes)."""

    def __init__(self, config: Config, first_step: int):
        self.first, self.last = first_step, first_step + config.run.profile_steps - 1
        self.remote = data.join_url(config.run.dir, "tb")
        self.local = tempfile.mkdtemp(prefix="trm-profile-")

    def before_step(self, step: int) -> None:
        if step == self.first:
            import torch_xla.debug.profiler as xp

            xp.start_trace(self.local)

    def after_step(self, step: int, say) -> None:
        if step == self.last:
            import torch_xla.core.xla_model as xm
            import torch_xla.debug.profiler as xp

            import checkpoint

            xm.wait_device_ops()
            xp.stop_trace()
            for root, _, files in os.walk(self.local):
                for name in files:
                    relative = os.path.relpath(os.path.join(root, name), self.local)
                    with open(os.path.join(root, name), "rb") as f:
                        checkpoint.write_bytes(data.join_url(self.remote, *relative.split(os.sep)), f.read())
            say(f"XLA profile of steps {self.first}-{self.last} written to {self.remote}/plugins/profile")


def _raise_in_main_thread(future) -> None:
    if future.exception() is not None:  # a failed metrics read must not pass silently
        import _thread
        print(f"error: reading metrics failed: {future.exception()!r}", file=sys.stderr, flush=True)
        _thread.interrupt_main()


def cli(argv: list[str] | None = None) -> Config:
    """The training configuration from the command line (a preset name, then overrides)."""
    config = tyro.extras.overridable_config_cli(PRESETS, args=argv)
    if config.data.path == PRESETS["demo"][1].data.path and not os.path.exists(config.data.path):
        import build_data

        print(f"building the demo dataset at {config.data.path}", flush=True)
        build_data.build_demo(config.data.path, seed=0)
    return config


def export(source: tyro.conf.Positional[str], out: str) -> None:
    """Write the EMA weights of a checkpoint as one model.safetensors (config in its metadata).

    source: a run directory (its latest committed checkpoint) or one checkpoint directory.
    out: where to write, local or gs:// (e.g. gs://BUCKET/models/sudoku.safetensors).
    """
    import checkpoint

    if checkpoint.exists(data.join_url(source, checkpoint.COMMIT_MARKER)):
        url = source
    else:
        found = checkpoint.list_checkpoints(source)
        if not found:
            raise SystemExit(f"error: no committed checkpoint in {source} (looked in {data.join_url(source, 'checkpoints')})")
        url = found[0][1]
    checkpoint.export_model(url, out)
    print(f"exported the EMA weights of {url} to {out}", flush=True)


def config_from_dict(saved: dict) -> Config:
    return Config(data=DataConfig(**saved["data"]), model=TRMConfig(**saved["model"]),
                  optim=OptimConfig(**saved["optim"]), eval=EvalConfig(**saved["eval"]), run=RunConfig(**saved["run"]))


def load_weights_for_eval(source: str, base: Config, overrides: list[str]):
    """(config, `model/*` weights, step, fingerprint of the identifiers the weights were trained
    on or None) from a run directory or checkpoint (EMA weights and the run's config), an
    exported model.safetensors (its model config) or a reference checkpoint (the sizes its
    tensors show, the rest from the preset `base`); `overrides` (command-line flags) apply on top."""
    import checkpoint
    from model import reference_config

    def with_overrides(config: Config) -> Config:
        return tyro.cli(Config, default=config, args=overrides)

    if source.endswith(".safetensors"):
        weights, model_config, trained_on = checkpoint.read_exported(source)
        config = with_overrides(dataclasses.replace(base, model=TRMConfig(**model_config)))
        return config, {f"model/{k}": v for k, v in weights.items()}, 0, trained_on
    url = source if checkpoint.exists(data.join_url(source, checkpoint.COMMIT_MARKER)) else None
    if url is None and checkpoint.list_checkpoints(source):
        url = checkpoint.list_checkpoints(source)[0][1]
    if url is not None:
        tensors, state = checkpoint.read_checkpoint(url, names=lambda n: n.startswith(("model/", "ema/")))
        weights = {k: tensors.get(f"ema/{k.removeprefix('model/')}", v) for k, v in tensors.items() if k.startswith("model/")}
        return with_overrides(config_from_dict(state["config"])), weights, state["step"], state.get("dataset_identifiers")
    # A reference checkpoint: its table must fit the dataset as it is (no resizing for evaluation).
    from model import load_reference_state_dict

    state_dict = read_reference_checkpoint(source)
    try:
        model_config = reference_config(state_dict, base.model)
        # The weights do not say seq_len: take the dataset's unless a flag says otherwise.
        data_path = with_overrides(base).data.path
        try:
            model_config = dataclasses.replace(model_config, seq_len=data.read_metadata(data_path, "test").seq_len)
        except data.DatasetError:
            pass  # reported with its fix when the dataset is opened
        config = with_overrides(dataclasses.replace(base, model=model_config))
        model = TRM(config.model)
        load_reference_state_dict(model, state_dict, resize_puzzle_table=False)
    except ValueError as e:
        raise SystemExit(f"error: {source}: {e}")
    return config, {f"model/{k}": v for k, v in model.state_dict().items()}, 0, None


def evaluate_command(argv: list[str]) -> dict:
    """`python train.py eval [PRESET] --init-from URL --data.path URL [overrides]`: evaluate a
    run directory / checkpoint, an exported model.safetensors or a reference checkpoint on a
    dataset's test split; prints and saves the metrics (and ARC scores) under
    {run.dir}/eval/step_N/."""
    import torch_xla

    args, source = [], None
    for i, arg in enumerate(argv):  # --init-from URL or --init-from=URL
        if arg.startswith("--init-from="):
            source = arg.split("=", 1)[1]
        elif arg == "--init-from" and i + 1 < len(argv):
            source = argv[i + 1]
        elif not (i > 0 and argv[i - 1] == "--init-from"):
            args.append(arg)
    if not source:
        raise SystemExit("error: eval needs --init-from URL (a run directory, checkpoint, exported "
                         "model.safetensors or reference checkpoint)")
    preset = args.pop(0) if args and args[0] in PRESETS else "sudoku-mlp"
    config, weights, step, trained_on = load_weights_for_eval(source, PRESETS[preset][1], args)
    table = weights.get("model/puzzle_embedding.weight")
    config, _, test_set, sharding, device_kind, _ = start(config, None if table is None else table.shape[0],
                                                          trained_on, source)
    host, num_hosts = sharding.process_index(), sharding.process_count()
    say = print if sharding.is_main_process() else (lambda *a, **k: None)
    mesh = sharding.data_mesh()
    trainer = Trainer(config, sharding, mesh, weights)
    batches = data.EvalBatches(test_set, config.optim.global_batch_size, process_index=host, process_count=num_hosts,
                               max_examples=config.eval.max_examples, seed=config.run.seed)
    trainer.init_carries(sharding.host_batch_to_global(batches.batch(0), mesh))
    torch_xla.sync()
    say(f"evaluating {source} (step {step}) on {batches.num_examples} examples of {config.data.path} "
        f"on {device_kind} ({len(batches)} batches)", flush=True)
    started = time.time()
    arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None
    result, submission = evaluate(trainer, batches, torch_xla.sync, arc, lambda *a: say(*a, flush=True),
                                  data.join_url(config.run.dir, "eval"), step, config.eval.arc_aggregate)
    out = data.join_url(config.run.dir, "eval", f"step_{step}")
    if sharding.is_main_process():
        import checkpoint

        checkpoint.write_bytes(data.join_url(out, "metrics.json"), json.dumps(dict(result, source=source), indent=2).encode())
        if submission is not None:
            write_submission(out, submission)
    scores = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
                       if k not in ("count", "num_examples"))
    say(f"eval of {source}: {scores}  ({time.time() - started:.0f}s); saved to {out}", flush=True)
    return result


def command_line(argv: list[str]) -> int:
    if argv[:1] == ["export"]:
        tyro.cli(export, args=argv[1:])
        return 0
    if argv[:1] == ["eval"]:
        evaluate_command(argv[1:])
        return 0
    result = main(cli(argv))
    return 0 if result["final"] is not None or result["preempted"] else 1


if __name__ == "__main__":
    sys.exit(command_line(sys.argv[1:]))
