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
from arc_eval import ArcEvaluator, write_submission
from checkpoint import Block, CheckpointWriter, assign_owners
from model import EMA, TRM, AdamATan2, Carry, SignSGD, TRMConfig, loss_and_metrics

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
    """Evaluate every this many epochs (and always at the end)."""
    max_examples: Optional[int] = None
    """Cap intermediate evaluations to a fixed seeded subset of this many test examples
    (the final evaluation uses all); None evaluates everything every time."""
    arc: bool = False
    """Score ARC pass@1/2/5/10 by voting over augmentations and write submission.json
    (needs the ARC builder's identifiers.json and test_puzzles.json; on in the arc presets)."""


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
    eval=dict(every_epochs=10000, arc=True),
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
    # The demo keeps the presets' bfloat16 activations, so the first command users run takes the
    # numerics of the real runs (on 2 cores: 100% exact; float32 99.0% with ~13% less CPU time).
    "demo": ("4x4 Sudoku built locally, a tiny TRM on the CPU mesh in minutes",
             _preset(data=dict(path="data/demo"),
                     model=dict(seq_len=16, vocab_size=6, hidden_size=64, num_heads=4, expansion=2.0,
                                H_cycles=2, L_cycles=2, puzzle_emb_ndim=64, puzzle_emb_len=1,
                                halt_max_steps=4, forward_dtype="bfloat16"),
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


def config_fingerprint(config: Config) -> str:
    """Text that differs whenever the flags or the code differ (compared across hosts)."""
    sources = []
    for name in ("train.py", "model.py", "data.py", "sharding.py"):
        with open(os.path.join(PROJECT_DIR, name), "rb") as f:
            sources.append(f"{name}:{hashlib.sha256(f.read()).hexdigest()}")
    return json.dumps(dataclasses.asdict(config), sort_keys=True) + "\n" + "\n".join(sources)


# ----------------------------------------------------------------------------------------------
# The training state and the step


TRAIN_METRICS = ("count", "accuracy", "exact_accuracy", "q_halt_accuracy", "steps", "lm_loss", "q_halt_loss")
EVAL_METRICS = ("count", "accuracy", "exact_accuracy", "q_halt_accuracy", "steps")


class Trainer:
    """Model, optimizers, EMA and ACT carry on the XLA device, and the traced step.

    `restore` (CPU tensors under checkpoint names, see `named_state`) replaces the fresh
    state: a full checkpoint, or only `model/*` weights to start from.
    """

    def __init__(self, config: Config, sharding, mesh, restore: dict[str, torch.Tensor] | None = None):
        self.config, self.sharding, self.mesh = config, sharding, mesh
        self.device = sharding.device()
        restore = restore or {}
        torch.manual_seed(config.run.seed)  # identical initial weights on every host
        model = TRM(config.model, exploration_seed=config.run.seed).train()
        if restore:
            model.load_state_dict({k.removeprefix("model/"): v for k, v in restore.items() if k.startswith("model/")})
        self.model = model.to(self.device)
        o = config.optim
        self.adam = AdamATan2(self.model.parameters(), betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        self.sign_sgd = (SignSGD(self.model.puzzle_embedding, weight_decay=o.puzzle_emb_weight_decay)
                         if config.model.puzzle_emb_ndim > 0 else None)
        self.adam.init_state()
        self.ema = EMA(self.model, rate=o.ema_rate)
        self.carry: Carry | None = None
        self.eval_carry: Carry | None = None
        self.captured = None
        for name, tensor in self.named_state().items():
            if name in restore and not name.startswith("model/"):
                tensor.data = restore[name].to(self.device)
        for tensor in self.named_state().values():
            sharding.replicate(tensor, mesh)
        if "carry/rng_counter" in restore:
            host_rows = {k.removeprefix("carry/"): v for k, v in restore.items()
                         if k.startswith("carry/") and v.ndim}
            restored = self.sharding.host_batch_to_global(host_rows, mesh)
            restored["rng_counter"] = sharding.replicate(restore["carry/rng_counter"].to(self.device), mesh)
            self.restored_carry = Carry.from_tensors(restored)
        else:
            self.restored_carry = None

    def named_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the training state under its checkpoint name (not the carries)."""
        state = {f"model/{n}": t for n, t in self.model.state_dict(keep_vars=True).items()}
        state.update({f"ema/{n}": t for n, t in self.ema.shadow.items()})
        for name, p in self.model.named_parameters():
            state.update({f"adam/{name}/{k}": v for k, v in self.adam.state[p].items()})
        return state

    def checkpoint_blocks(self, process_index: int, process_count: int) -> dict[str, Block]:
        """This host's share of the state, copied to the CPU: the replicated tensors it owns
        and its rows of the carry."""
        state = self.named_state()
        owners = assign_owners({n: t.numel() * t.element_size() for n, t in state.items()}, process_count)
        blocks = {n: Block(self.sharding.local_copy(t), tuple(t.shape)) for n, t in state.items()
                  if owners[n] == process_index}
        for name, t in self.carry.tensors().items():
            if t.ndim == 0:
                if process_index == 0:
                    blocks[f"carry/{name}"] = Block(self.sharding.local_copy(t), ())
            else:
                start, rows = self.sharding.local_rows(t)
                blocks[f"carry/{name}"] = Block(rows, tuple(t.shape), start)
        return blocks

    def init_carries(self, batch: dict[str, torch.Tensor]) -> None:
        """All-halted carries for training and evaluation, so that the first step of each
        loads its whole batch. Created before the first step (and materialised by the caller's
        sync) so that every step, the first included, traces the same graph."""
        self.carry = self.restored_carry or self._sharded_carry(self.model.initial_carry(batch))
        self.eval_carry = self._sharded_carry(self.model.initial_carry(batch))

    def _sharded_carry(self, carry: Carry) -> Carry:
        return Carry.from_tensors({k: self.sharding.shard_batch_dim(v, self.mesh) for k, v in carry.tensors().items()})

    def step(self, batch: dict[str, torch.Tensor], lr: float, puzzle_emb_lr: float) -> torch.Tensor:
        """One training step at these learning rates; returns the metric vector (lazy)."""
        # Uploaded as graph inputs (device data), so a new value does not change the graph.
        lrs = torch.tensor([lr, puzzle_emb_lr], dtype=torch.float32).to(self.device)
        if self.config.run.capture_step:
            if self.captured is None:
                from capture import CapturedTrainStep  # imports torch_xla: not at module import

                self.captured = CapturedTrainStep(self)
            return self.captured(batch, lrs)
        self.set_lrs(lrs[0], lrs[1])
        return self.train_step(batch)

    def set_lrs(self, lr: torch.Tensor, puzzle_emb_lr: torch.Tensor) -> None:
        for group in self.adam.param_groups:
            group["lr"] = lr
        if self.sign_sgd is not None:
            self.sign_sgd.lr = puzzle_emb_lr

    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One ACT segment, backward, both optimizers and the EMA; returns the metric vector
        (TRAIN_METRICS order) as a lazy device tensor."""
        carry, outputs = self.model(self.carry, batch)
        loss, metrics = loss_and_metrics(carry, outputs)
        (loss / self.config.optim.global_batch_size).backward()
        self.adam.step()
        self.adam.zero_grad(set_to_none=True)
        if self.sign_sgd is not None:
            self.sign_sgd.step()
            self.sign_sgd.zero_grad()
        self.ema.update(self.model)
        self.carry = self._sharded_carry(carry)
        return torch.stack([metrics[k] for k in TRAIN_METRICS])

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ACT step in eval mode on the persistent eval carry: the metric vector of rows
        that halted (EVAL_METRICS order), the predicted tokens and the q_halt logits."""
        carry, outputs = self.model(self.eval_carry, batch)
        _, metrics = loss_and_metrics(carry, outputs)
        self.eval_carry = self._sharded_carry(carry)
        return torch.stack([metrics[k] for k in EVAL_METRICS]), outputs["logits"].argmax(-1), outputs["q_halt_logits"]


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
        arc = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith("pass@"))
        self.say(f"eval @ step {step}: exact_accuracy {result['exact_accuracy']:.4f}  "
                 f"accuracy {result['accuracy']:.4f}  q_halt_accuracy {result['q_halt_accuracy']:.4f}  "
                 f"steps {result['steps']:.2f}  {arc + '  ' if arc else ''}"
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


OPERATIONAL_FIELDS = {"data.cache_dir", "run.log_every", "run.device", "run.cpu_devices", "run.ckpt_every",
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


def load_initial_weights(url: str, model_config: TRMConfig) -> dict[str, torch.Tensor]:
    """`model/*` tensors from an exported model.safetensors or a reference checkpoint."""
    import io

    import checkpoint
    from model import load_reference_state_dict

    model = TRM(model_config)
    if url.endswith(".safetensors"):
        weights, _ = checkpoint.read_exported(url)
        model.load_state_dict(weights)
    else:
        state_dict = torch.load(io.BytesIO(checkpoint.read_bytes(url)), map_location="cpu", weights_only=True)
        load_reference_state_dict(model, state_dict)
    return {f"model/{k}": v for k, v in model.state_dict().items()}


def evaluate(trainer: Trainer, batches: data.EvalBatches, sync, arc=None, say=lambda *a: None):
    """Exactly halt_max_steps ACT steps per batch with the EMA weights; the reference's
    metrics over real (non-padding) examples, plus ARC pass@k when `arc` (an ArcEvaluator)
    is given. Returns (metrics, ARC submission or None)."""
    sharding, o = trainer.sharding, trainer.config.optim
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
    result = summarize(EVAL_METRICS, sums.cpu().numpy(), 1, o.global_batch_size)
    result["num_examples"] = batches.num_examples
    submission = None
    if arc is not None:
        merged = arc.merge(sharding.all_gather_object(arc.summary()))
        result.update(arc.result(merged))
        submission = arc.submission(merged)
    return result, submission


def start(config: Config, weights_rows: int | None = None):
    """Everything that can be checked without a device, then the runtime and the host group.
    Returns (config with the dataset's identifier count, train set, test set, the sharding
    module, "TPU" or "CPU"). `weights_rows`: rows of a given puzzle-embedding table, which
    must match the dataset's identifiers."""
    try:
        train_set, test_set = data.open_train_test(config.data.path, cache_dir=config.data.cache_dir)
        config = check_against_dataset(config, train_set.metadata)
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
    return config, train_set, test_set, sharding, device_kind


def main(config: Config) -> dict:
    """Train (and evaluate) as configured, resuming from the run directory's latest
    checkpoint; returns the logged history, the evaluations and the XLA counters."""
    # 1-2. Checks, then the runtime, the mesh and the hosts.
    config, train_set, test_set, sharding, device_kind = start(config)
    import torch_xla

    import checkpoint

    num_devices, local_devices = sharding.device_counts()
    num_hosts, host = sharding.process_count(), sharding.process_index()
    o = config.optim
    total_steps = data.total_train_steps(train_set.metadata, o.epochs, o.global_batch_size)
    steps_per_epoch = total_steps / o.epochs
    if o.max_steps is not None:
        total_steps = min(total_steps, o.max_steps)
    eval_every = max(1, round(config.eval.every_epochs * steps_per_epoch))
    log = RunLog(config, total_steps, sharding.is_main_process())
    log.say(f"TRM on {device_kind}: {num_devices} devices on {num_hosts} host(s) ({local_devices} here); "
            f"global batch {o.global_batch_size}, {total_steps} steps, evaluation every {eval_every} steps")

    # 3. Resume from the latest committed checkpoint, or start (optionally from given weights).
    def host_rows(shape):
        return host * shape[0] // num_hosts, (host + 1) * shape[0] // num_hosts

    found = checkpoint.latest_checkpoint(config.run.dir, lambda url: checkpoint.read_checkpoint(url, host_rows))
    restore, start_step = None, 0
    if found:
        start_step, url, (restore, saved) = found
        differences = config_differences(saved["config"], dataclasses.asdict(config))
        if differences and not config.run.allow_config_change:
            raise SystemExit(f"error: {config.run.dir} was created with another configuration:\n  "
                             + "\n  ".join(differences)
                             + "\nuse the original flags, a new --run.dir, or --run.allow-config-change")
        log.say(f"resuming from {url} (step {start_step})")
    elif config.run.init_from:
        restore = load_initial_weights(config.run.init_from, config.model)
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

    def save(step: int) -> None:
        log.drain()  # the copy waits for this step anyway; draining first keeps the counts apart
        before = xla_counters()["transfers"]
        blocks = trainer.checkpoint_blocks(host, num_hosts)  # the loop pauses only for this copy
        checkpoint_transfers.append(xla_counters()["transfers"] - before)
        writer.save(step, blocks, {"step": step, "config": dataclasses.asdict(config)})

    arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None

    def run_eval(step: int, final: bool) -> None:
        started = time.time()
        batches = data.EvalBatches(test_set, o.global_batch_size, process_index=host, process_count=num_hosts,
                                   max_examples=None if final else config.eval.max_examples, seed=config.run.seed)
        result, submission = evaluate(trainer, batches, torch_xla.sync, arc, log.say)
        log.evaluation(result, step, time.time() - started)
        if submission is not None and sharding.is_main_process():
            log.say(f"ARC submission: {write_submission(data.join_url(config.run.dir, 'eval', f'step_{step}'), submission)}")

    stop_requested = []
    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    check_stop_every = 1 if num_hosts == 1 else config.run.preempt_check_every
    profile = Profile(config, start_step + 10) if config.run.profile_steps and sharding.is_main_process() else None

    # 4. The loop. Nothing in it reads a device value: metric sums are read by a background
    # thread every log_every steps, while the host traces the following steps.
    trainer.init_carries(sharding.host_batch_to_global(train_batches.batch(start_step), mesh))
    torch_xla.sync()  # materialise weights, optimizer state and carries before the first step
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
        if step % config.run.log_every == 0 or step == total_steps:
            log.train_window(window_sums, step, window_steps, time.time() - window_start, lr)
            window_sums = torch.zeros(len(TRAIN_METRICS)).to(trainer.device)
            window_start, window_steps = time.time(), 0
        if step % check_stop_every == 0 and sharding.any_host(bool(stop_requested)):
            save(step)
            writer.wait()
            log.say(f"SIGTERM: saved checkpoint {checkpoint.step_dir(config.run.dir, step)}; "
                    "run the same command again to resume")
            preempted = True
            break
        if step % config.run.ckpt_every == 0 and step != total_steps:
            save(step)
        if step % eval_every == 0 and step != total_steps:
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
        print(f"building the demo dataset at {config.data.path}", flush=True)
        data.build_demo(config.data.path, seed=0)
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


def load_weights_for_eval(source: str, base: Config) -> tuple[Config, dict[str, torch.Tensor], int]:
    """(config, `model/*` weights, step) from a run directory or checkpoint (EMA weights and the
    run's config), an exported model.safetensors (its model config) or a reference checkpoint
    (the preset's model config)."""
    import checkpoint

    if source.endswith(".safetensors"):
        weights, model_config = checkpoint.read_exported(source)
        return dataclasses.replace(base, model=TRMConfig(**model_config)), {f"model/{k}": v for k, v in weights.items()}, 0
    url = source if checkpoint.exists(data.join_url(source, checkpoint.COMMIT_MARKER)) else None
    if url is None and checkpoint.list_checkpoints(source):
        url = checkpoint.list_checkpoints(source)[0][1]
    if url is not None:
        tensors, state = checkpoint.read_checkpoint(url, names=lambda n: n.startswith(("model/", "ema/")))
        weights = {k: tensors.get(f"ema/{k.removeprefix('model/')}", v) for k, v in tensors.items() if k.startswith("model/")}
        return config_from_dict(state["config"]), weights, state["step"]
    return base, load_initial_weights(source, base.model), 0


def evaluate_command(argv: list[str]) -> dict:
    """`python train.py eval [PRESET] --init-from URL --data.path URL [overrides]`: evaluate a
    run directory / checkpoint, an exported model.safetensors or a reference checkpoint on a
    dataset's test split; prints and saves the metrics (and ARC scores) under
    {run.dir}/eval/step_N/."""
    import torch_xla

    args = list(argv)
    if "--init-from" not in args:
        raise SystemExit("error: eval needs --init-from URL (a run directory, checkpoint, exported "
                         "model.safetensors or reference checkpoint)")
    at = args.index("--init-from")
    source = args[at + 1]
    del args[at:at + 2]
    preset = args.pop(0) if args and args[0] in PRESETS else "sudoku-mlp"
    config, weights, step = load_weights_for_eval(source, PRESETS[preset][1])
    config = tyro.cli(Config, default=config, args=args)
    table = weights.get("model/puzzle_embedding.weight")
    config, _, test_set, sharding, device_kind = start(config, None if table is None else table.shape[0])
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
    result, submission = evaluate(trainer, batches, torch_xla.sync, arc, lambda *a: say(*a, flush=True))
    out = data.join_url(config.run.dir, "eval", f"step_{step}")
    if sharding.is_main_process():
        import checkpoint

        checkpoint.write_bytes(data.join_url(out, "metrics.json"), json.dumps(dict(result, source=source), indent=2).encode())
        if submission is not None:
            write_submission(out, submission)
    scores = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k not in ("count", "num_examples"))
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
