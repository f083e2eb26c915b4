"""Train a Tiny Recursive Model (TRM) on a Cloud TPU slice or on a virtual CPU mesh.

Every host of a slice runs this same command; one program spans all devices (PyTorch/XLA SPMD,
data parallel). On a laptop:

    python train.py demo                 # builds data/demo if missing, trains on 8 virtual CPU devices

With a dataset in the reference format (local path or gs://), a preset and any overrides:

    python train.py sudoku-mlp --data.path gs://BUCKET/data/sudoku-extreme-1k-aug-1000 \\
        --run.dir gs://BUCKET/runs/sudoku-mlp-1
    python train.py arc1 --optim.lr 3e-4 --data.path gs://BUCKET/data/arc1 --run.dir gs://BUCKET/runs/x
    python train.py --help               # the presets and the commands
    python train.py arc1 --help          # every setting, with its preset value
    python train.py eval --help          # each command's flags

Relaunching the same command continues from the run directory's latest checkpoint; SIGTERM
(a spot VM's preemption notice) or Ctrl-C saves one and exits 0 (or 75 when that does not end
within run.shutdown_timeout_s; a second signal exits at once). Other commands:

    python train.py export gs://BUCKET/runs/NAME --out gs://BUCKET/models/NAME.safetensors
    python train.py eval --init-from gs://BUCKET/runs/NAME --data.path gs://BUCKET/data/...
    python train.py eval arc1 --init-from reference_step_123.pt --data.path gs://BUCKET/data/arc1
    python train.py predict demo --init-from runs/demo --puzzle 1.3..4....2.2...   # or --puzzle-file, --task

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
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Literal

import torch
import tyro

import checkpoint
import compile_cache
import data
import report
import storage
from arc import ArcEvaluator, write_submission
from checkpoint import CheckpointWriter
from evaluate import evaluate
from model import TRM, TRMConfig, range_problems, ranged
from report import HostLog, Profile, RunLog, format_duration
from trainer import Trainer

PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))
# Exit status when a relaunch may help (EX_TEMPFAIL): a hang (the watchdog), a lost peer host,
# storage failing beyond its retries. launch.sh train --retry relaunches on it; 1 means a failure
# that a relaunch would repeat.
EXIT_RETRYABLE = 75


# ----------------------------------------------------------------------------------------------
# Configuration


def resumable(default, **limits):
    """A config field that a relaunch of the run may change: it does not change the math of the
    training (the resume check in `config_differences` lets it differ). `limits`: its allowed
    range, as for `ranged` (e.g. ge=1), checked by `check_config`."""
    return ranged(default, resumable=True, **limits)


@dataclass
class DataConfig:
    path: str = "data/sudoku-extreme-1k-aug-1000"
    """Dataset root in the reference's format: a local path or an fsspec URL (gs://...)."""
    cache_dir: str | None = resumable(None)
    """Local directory for the cached arrays (default ~/.cache/trm-data/<hash of path>)."""


# AdamATan2's betas must stay below 1 in float32 (optim.AdamATan2 refuses 0.99999999, which rounds to 1).
_BETA_MAX = 0.99999994
_BETA_NOTE = "below 1 in float32"


@dataclass
class OptimConfig:
    global_batch_size: int = ranged(768, ge=1)
    """Examples per step over all hosts (the paper's 768); must divide by the device count."""
    epochs: int = ranged(50000, ge=1)
    """Training length in epochs (an epoch draws one puzzle per group)."""
    max_steps: int | None = resumable(None, ge=0, note="leave it out to train for optim.epochs")
    """Stop after this many steps instead (for quick runs; 0 saves and evaluates the initial or
    --run.init-from weights); None trains for `epochs`."""
    lr: float = ranged(1e-4, ge=0)
    """Peak learning rate of AdamATan2."""
    lr_min_ratio: float = ranged(1.0, ge=0, le=1, note="a fraction of the peak lr")
    """Cosine decay floor as a fraction of lr (1.0: constant after warmup, as in the paper)."""
    lr_warmup_steps: int = ranged(2000, ge=0)
    """Linear warmup steps from 0."""
    beta1: float = ranged(0.9, ge=0, le=_BETA_MAX, note=_BETA_NOTE)
    """AdamATan2 beta1."""
    beta2: float = ranged(0.95, ge=0, le=_BETA_MAX, note=_BETA_NOTE)
    """AdamATan2 beta2."""
    weight_decay: float = ranged(1.0, ge=0)
    """Decoupled weight decay of AdamATan2."""
    puzzle_emb_lr: float = ranged(1e-4, ge=0)
    """Peak learning rate of the puzzle-embedding SignSGD (same schedule)."""
    puzzle_emb_weight_decay: float = ranged(1.0, ge=0)
    """Decoupled weight decay of the puzzle embedding."""
    ema_rate: float = ranged(0.999, ge=0, lt=1, note="0 evaluates the trained weights as they are")
    """EMA rate of the weights used for evaluation and export."""


@dataclass
class EvalConfig:
    every_epochs: int = resumable(5000, ge=1, note="the final evaluation always runs; set it to optim.epochs "
                                                   "for only that one")
    """Evaluate every this many epochs, counted in epochs as the reference does; the final
    evaluation at the last step takes the place of the one due at the end."""
    max_examples: int | None = resumable(None, ge=1, note="leave it out to evaluate every test example")
    """Cap intermediate evaluations to a fixed seeded subset of this many test examples
    (the final evaluation uses all); None evaluates everything every time."""
    arc: bool = resumable(False)
    """Score ARC pass@1/2/5/10/100/1000 by voting over augmentations and write submission.json
    (needs the ARC builder's identifiers.json and test_puzzles.json; on in the arc presets)."""
    arc_aggregate: bool = resumable(False)
    """Also vote over every evaluation of this run so far (aggregated_pass@k, and the submission),
    as the reference reports ARC scores; `train.py eval` votes over its own and the saved votes
    of earlier steps in {run.dir}/eval/step_N/arc_votes.json.gz. Needs --eval.arc."""


@dataclass
class RunConfig:
    dir: str = resumable("runs/default")
    """Run directory (local or gs://): config, checkpoints, TensorBoard logs."""
    seed: int = ranged(0, ge=0, le=2**32 - 1)
    """Seed of the initial weights, the data order and the halting exploration."""
    device: Literal["auto", "tpu", "cpu"] = resumable("auto")
    """auto (TPU if attached or PJRT_DEVICE says so), tpu (fail without one), cpu (virtual mesh)."""
    cpu_devices: int = resumable(8, ge=1)
    """Virtual devices of the CPU mesh (device cpu)."""
    log_every: int = resumable(100, ge=1)
    """Read metrics back and print a progress line every this many steps."""
    ckpt_every: int = resumable(2000, ge=1, note="the end of the run and SIGTERM always save one")
    """Save a checkpoint every this many steps (and always at the end and on SIGTERM)."""
    keep_checkpoints: int = resumable(3, ge=1, note="the latest is always kept")
    """Committed checkpoints to keep; older ones are deleted."""
    init_from: str | None = resumable(None)
    """Start from these weights when the run directory has no checkpoint yet: a run or checkpoint
    directory (its EMA weights), an exported model.safetensors or a reference checkpoint. A puzzle
    table trained on other identifiers restarts from its mean row (fine-tuning on new puzzles)."""
    allow_config_change: bool = resumable(False)
    """Resume even though the run directory was created with a different configuration."""
    preempt_check_every: int = resumable(10, ge=1)
    """On several hosts, agree every this many steps whether any host got SIGTERM."""
    shutdown_timeout_s: float = resumable(90.0, gt=0)
    """After SIGTERM or Ctrl-C, exit with status 75 (relaunch resumes) if still running this long later."""
    compile_cache_dir: str = resumable("~/.cache/trm-xla")
    """Persistent XLA compilation cache on each TPU host, so a relaunch does not recompile."""
    compile_cache_url: str | None = resumable(None)
    """Keep the compilation cache's files under {this}/{key}/ too (key: accelerator type, torch_xla
    and libtpu versions, code hash), so that a new VM does not recompile: each host restores them
    before the runtime starts, process 0 uploads new ones after the first steps and at the end
    (best effort; compile_cache.py). launch.sh train passes gs://BUCKET/xla-cache."""
    shard_puzzle_table: bool = resumable(True)
    """Split the puzzle-embedding table's rows over the devices (each holds and saves 1/N of it);
    a table with fewer rows than devices stays replicated. False replicates it on every device."""
    capture_step: bool = resumable(True)
    """Trace the training step and the evaluation ACT step once each and replay them as XLA
    computations (host time per step: README, Speed); False re-traces them every step."""
    profile_steps: int = resumable(0, ge=0, note="0 = off")
    """Capture an XLA profile of this many steps (from the 10th step of this launch) into
    {run.dir}/tb/plugins/profile for TensorBoard's profile tab; 0 = off."""
    start_over: bool = resumable(False)
    """Start from step 0 when every committed checkpoint in run.dir is unreadable (they are moved
    to checkpoints-unreadable-TIME/); a readable one is still resumed, so relaunching with it is safe."""
    watchdog_minutes: float = resumable(30.0, ge=0, note="0 = off")
    """Exit (status 75, so launch.sh --retry relaunches) when no training step or evaluation batch
    completes for this long: a hung host or collective; 0 = off."""


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


def flag(name: str) -> str:
    """The command-line spelling of a dotted config field: optim.global_batch_size ->
    --optim.global-batch-size."""
    return "--" + name.replace("_", "-")


def check_config(config: Config) -> None:
    """Every check of the flags that needs neither the dataset nor a device, in one place, run
    before the dataset is opened and the runtime starts: each numeric field within the range
    declared on it (`ranged` / `resumable(..., ge=...)`), the model's sizes fitting together, the
    URLs spelled so that fsspec can open them. ConfigError lists every problem, one per line,
    each naming the field, its flag and the value."""
    problems = []
    for section in dataclasses.fields(Config):
        for name, value, rule, note in range_problems(getattr(config, section.name)):
            dotted = f"{section.name}.{name}"
            problems.append(f"{dotted}={value!r} must be {rule} ({note + '; ' if note else ''}"
                            f"set it with {flag(dotted)})")
    if not any(p.startswith("model.") for p in problems):
        problems += [f"model.{p}" for p in config.model.problems(ranges=False)]
    if config.eval.arc_aggregate and not config.eval.arc:
        problems.append("eval.arc_aggregate votes over ARC evaluations but eval.arc is off: "
                        "pass --eval.arc too (needs an ARC dataset)")
    urls = [("data.path", config.data.path, False), ("run.dir", config.run.dir, False),
            ("data.cache_dir", config.data.cache_dir, True), ("run.init_from", config.run.init_from, False)]
    for name, url, local_only in urls:
        if url is not None or name in ("data.path", "run.dir"):
            try:
                storage.check_url(url, name, local_only)
            except storage.StorageError as e:
                problems.append(f"{e} (set it with {flag(name)})")
    if problems:
        raise ConfigError("\nerror: ".join(problems))


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


DATASET_FIELDS = ("model.num_puzzle_identifiers",)
"""Fields that check_against_dataset fills in from the dataset (seq_len and vocab_size are only
checked against it)."""


def flat_config(config: Config) -> dict:
    """{dotted field name: value} of a Config."""
    return {f"{section.name}.{name}": value for section in dataclasses.fields(Config)
            for name, value in dataclasses.asdict(getattr(config, section.name)).items()}


def flag_with_value(name: str, value) -> str:
    """How to set a field on the command line: --optim.lr 0.001, --eval.arc / --eval.no-arc."""
    if isinstance(value, bool):
        section, _, field_name = name.rpartition(".")
        return flag(f"{section}.{'' if value else 'no_'}{field_name}")
    import shlex

    return f"{flag(name)} {shlex.quote(str(value))}"


def settings_lines(given: Config, resolved: Config, preset: str | None = None) -> list[str]:
    """The run's settings as printed at start: the fields whose value differs from the preset's
    (what the flags changed), then those filled in from the dataset, one line each
    `--flag value (preset: X)`. `preset` defaults to the preset the config differs least from."""
    mine = flat_config(given)

    def changes(name):
        return [k for k, v in flat_config(PRESETS[name][1]).items() if mine[k] != v]
    preset = preset or min(PRESETS, key=lambda name: len(changes(name)))
    base, resolved_flat = flat_config(PRESETS[preset][1]), flat_config(resolved)
    lines = [f"settings: preset {preset}, and what differs from it (config.json in the run directory has them all):"]
    lines += [f"  {flag_with_value(k, mine[k])} (preset: {base[k]})" for k in changes(preset)
              if k not in DATASET_FIELDS]
    lines += [f"  {flag_with_value(k, resolved_flat[k])} (from the dataset; preset: {base[k]})"
              for k in DATASET_FIELDS]
    return lines


def check_batch_layout(global_batch_size: int, num_devices: int, num_hosts: int) -> None:
    if global_batch_size % num_devices:
        raise ConfigError(
            f"optim.global_batch_size={global_batch_size} does not divide over the {num_devices} devices "
            f"of this slice; use a multiple of {num_devices} "
            f"(e.g. {math.ceil(global_batch_size / num_devices) * num_devices})")
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
    """Text that differs whenever the flags or the code differ (compared across hosts): the
    config and a hash of every Python file of the project that a run executes."""
    sources = []
    for name in sorted(n for n in os.listdir(PROJECT_DIR) if n.endswith(".py")):
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


def resumable_fields() -> set[str]:
    """Dotted names of the fields declared with `resumable(...)`: those a relaunch may change."""
    defaults = Config()
    return {f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
            for f in dataclasses.fields(getattr(defaults, section.name)) if f.metadata.get("resumable")}


def config_differences(saved: dict, current: dict, prefix: str = "", may_change: set[str] | None = None) -> list[str]:
    """Fields (dotted) whose values differ, leaving out those that may change on resume."""
    may_change = resumable_fields() if may_change is None else may_change
    out = []
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, name + ".", may_change)
        elif a != b and name not in may_change:
            out.append(f"{name}: {a!r} in the run directory, {b!r} now")
    return out


def read_reference_checkpoint(url: str) -> dict[str, torch.Tensor]:
    """The state dict of a reference-implementation checkpoint (a torch.save file)."""
    import io

    return torch.load(io.BytesIO(storage.read_bytes(url)), map_location="cpu", weights_only=True)


def load_initial_weights(url: str, model_config: TRMConfig, dataset_identifiers: str | None = None,
                         say=print) -> dict[str, torch.Tensor]:
    """`model/*` tensors to start training from: the EMA weights of a run or checkpoint
    directory, an exported model.safetensors, or a reference checkpoint.

    Fine-tuning on other puzzles: when the weights' puzzle-embedding table was trained on other
    identifiers (another row count, or another fingerprint than `dataset_identifiers`), the
    dense weights are kept and every row of the table starts as the mean of the old rows (as the
    reference does), with one line said; the same identifiers keep the table."""
    from model import load_reference_state_dict, mean_row_table

    model = TRM(model_config)
    try:
        found = checkpoint.weights_of(url, say)
    except checkpoint.CheckpointError as e:
        raise ConfigError(str(e)) from None
    if found is None and not url.endswith(".safetensors"):
        load_reference_state_dict(model, read_reference_checkpoint(url))
        return {f"model/{k}": v for k, v in model.state_dict().items()}
    if found is None:
        weights, _, trained_on = checkpoint.read_exported(url)
    else:
        weights, state, _ = found
        trained_on = state.get("dataset_identifiers")
    table, expected = weights.get("puzzle_embedding.weight"), model.state_dict().get("puzzle_embedding.weight")
    if table is not None and expected is not None and table.shape[1:] == expected.shape[1:]:
        other_rows = table.shape[0] != expected.shape[0]
        if other_rows or (trained_on and dataset_identifiers and trained_on != dataset_identifiers):
            why = (f"{table.shape[0]} identifiers, this dataset {expected.shape[0]}" if other_rows else
                   f"identifiers with fingerprint {trained_on}, this dataset's {dataset_identifiers}")
            say(f"fine-tuning: the puzzle embedding of {url} was trained on {why}; the dense weights start "
                "from it and every table row from its mean row")
            weights["puzzle_embedding.weight"] = mean_row_table(table, expected.shape[0])
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ConfigError(f"the weights of {url} do not fit this model (check mlp_t, pos_encodings, "
                          f"hidden_size, L_layers, puzzle_emb_ndim): {e}") from None
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


def start(config: Config, weights_rows: int | None = None, weights_identifiers: str | None = None,
          weights_url: str = ""):
    """Everything that can be checked without a device, then the runtime and the host group.
    Returns (config with the dataset's identifier count, train set, test set, the sharding
    module, "TPU" or "CPU", the dataset's identifiers fingerprint). `weights_rows` and
    `weights_identifiers`: the rows of given weights' puzzle-embedding table and the fingerprint
    of the identifiers they were trained on, which must match the dataset's."""
    try:
        check_config(config)
        train_set, test_set = data.open_train_test(config.data.path, cache_dir=config.data.cache_dir)
        config = check_against_dataset(config, train_set.metadata)
        identifiers = data.identifiers_fingerprint(config.data.path)
        check_same_identifiers(weights_identifiers, identifiers, weights_url)
        if weights_rows is not None and weights_rows != train_set.metadata.num_puzzle_identifiers:
            raise ConfigError(f"the weights' puzzle embedding has {weights_rows} identifiers but the dataset at "
                              f"{config.data.path} has num_puzzle_identifiers="
                              f"{train_set.metadata.num_puzzle_identifiers}: evaluate on the dataset the model "
                              "was trained on")
    except (data.DatasetError, ConfigError) as e:
        raise SystemExit(f"error: {e}")

    import sharding

    compile_cache.restore_run(config.run)  # the bucket's copy, before the runtime reads the cache
    device_kind = sharding.start_runtime(config.run.device, config.run.cpu_devices, config.run.compile_cache_dir)
    num_devices, _ = sharding.device_counts()
    try:
        check_batch_layout(config.optim.global_batch_size, num_devices, sharding.process_count())
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    sharding.init_host_group()
    sharding.check_same_config(config_fingerprint(config))
    return config, train_set, test_set, sharding, device_kind, identifiers


def main(config: Config, preset: str | None = None) -> dict:
    """Train (and evaluate) as configured, resuming from the run directory's latest
    checkpoint; returns the logged history, the evaluations and the XLA counters. `preset`: the
    preset the flags were applied to (for the settings printed at start; default: the closest)."""
    # 1. Checks (before any device work), then the runtime, the mesh and the hosts; from then on
    # what this host prints also goes to {run.dir}/logs/host_I.launch-TIME.log.
    original = config
    config, train_set, test_set, sharding, device_kind, identifiers = start(config)
    launch = sharding.broadcast_object(time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    with HostLog(config.run.dir, sharding.process_index(), launch):
        if sharding.is_main_process():
            print("\n".join(settings_lines(original, config, preset)), flush=True)
        return training(config, train_set, test_set, sharding, device_kind, identifiers)


def training(config: Config, train_set: data.Dataset, test_set: data.Dataset, sharding, device_kind: str,
             identifiers: str | None) -> dict:
    """main() once the runtime runs: the run itself."""
    num_devices, local_devices = sharding.device_counts()
    num_hosts, host = sharding.process_count(), sharding.process_index()
    optim = config.optim
    full_steps = data.total_train_steps(train_set.metadata, optim.epochs, optim.global_batch_size)
    if full_steps < 1 and optim.max_steps != 0:
        examples = round(train_set.metadata.total_groups * train_set.metadata.mean_puzzle_examples)
        raise SystemExit(f"error: optim.epochs={optim.epochs} of this dataset's {examples} examples per epoch "
                         f"make no step of optim.global_batch_size={optim.global_batch_size}: raise "
                         f"--optim.epochs to at least {-(-optim.global_batch_size // max(examples, 1))} or lower "
                         "--optim.global-batch-size")
    total_steps = full_steps if optim.max_steps is None else min(full_steps, optim.max_steps)
    try:
        eval_steps = evaluation_steps(full_steps, optim.epochs, config.eval.every_epochs, total_steps)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    log = RunLog(config, total_steps, sharding.is_main_process(), sharding)
    log.say(f"TRM on {device_kind}: {num_devices} devices on {num_hosts} host(s) ({local_devices} here); "
            f"global batch {optim.global_batch_size}, {total_steps} steps, {len(eval_steps)} evaluations "
            f"(steps {', '.join(map(str, eval_steps[:3]))}{', ...' if len(eval_steps) > 4 else ''}"
            f"{', ' + str(eval_steps[-1]) if len(eval_steps) > 3 else ''})")

    # 2. Resume from the newest committed checkpoint (one decision for all hosts), or start
    # (optionally from given weights).
    mesh = sharding.data_mesh()
    start_step, trainer, resumed = resume_or_start(config, identifiers, sharding, mesh, log)
    log.continue_from(start_step)  # metrics.jsonl continues from here
    log.say(f"model: {sum(p.numel() for p in trainer.model.parameters()):,} parameters; data: {config.data.path}")
    data_index, data_count = sharding.data_split()  # this host's rows of every batch
    train_batches = data.TrainBatches(train_set, optim.global_batch_size, seed=config.run.seed,
                                      process_index=data_index, process_count=data_count)

    # 3. The periodic jobs; each decides for itself whether a step is its step.
    checkpoints = Checkpoints(config, trainer, log, identifiers, total_steps, start_step if resumed else None)
    preemption = Preemption(num_hosts, config.run.preempt_check_every, sharding,
                            ShutdownDeadline(config.run.shutdown_timeout_s))
    watchdog = Watchdog(config.run.watchdog_minutes, host)
    evaluations = Evaluations(config, trainer, test_set, log, eval_steps, preemption, watchdog)
    profile = Profile(config, start_step + 10, sharding.is_main_process(), sharding, log.say)
    cache_uploads = compile_cache.Uploader.for_run(config.run, sharding.is_main_process(), start_step)

    # 4. The loop. Nothing in it reads a device value: metric sums are read by a background
    # thread at the end of each logging window, while the host runs the following steps.
    trainer.init_carries(sharding.host_batch_to_global(train_batches.batch(start_step), mesh))
    sharding.sync()  # materialise weights, optimizer state and carries before the first step
    log.start_window(trainer.device)
    loop_start, preempted = time.time(), False
    batches = PrefetchedBatches(lambda step: sharding.host_batch_to_global(train_batches.batch(step - 1), mesh),
                                start_step + 1, total_steps)
    try:
        evaluations.catch_up(start_step, resumed)
        for step in range(start_step + 1, total_steps + 1):
            batch = batches.get(step)
            lr = lr_at(step, optim.lr, optim, total_steps)
            profile.before_step(step)
            log.add_step(trainer.step(batch, lr, lr_at(step, optim.puzzle_emb_lr, optim, total_steps)))
            sharding.sync()
            watchdog.progress(f"step {step}")
            profile.after_step(step)
            cache_uploads.after_step(step)
            stop = preemption.agreed_stop(step, log.nonfinite is not None)
            log.after_step(step, lr, end_window=stop or checkpoints.due(step))
            if stop:  # SIGTERM on some host (a NaN stops inside save instead)
                raise Preempted(step)
            checkpoints.after_step(step)
            evaluations.after_step(step)  # raises Preempted on SIGTERM between evaluation batches

        # 5. The final save and evaluation (a relaunch of a finished run only evaluates).
        checkpoints.save(total_steps)
        evaluations.run(total_steps, final=True)
        checkpoints.wait()
        log.say(f"done: {total_steps} steps in {format_duration(time.time() - loop_start)}; final exact accuracy "
                f"{100 * log.evals[-1]['exact_accuracy']:.2f}% on held-out puzzles")
    except Preempted as stop:
        checkpoints.save(stop.step, wait=True)
        log.say(f"stop requested (SIGTERM or Ctrl-C): saved checkpoint "
                f"{checkpoint.step_dir(config.run.dir, stop.step)}; "
                "run the same command again to resume")
        preempted = True
    finally:
        batches.close()
        checkpoints.close()  # a save under way commits (or is reported) however the loop ends
        watchdog.close()
        cache_uploads.close()  # best effort, bounded (after SIGTERM by the shutdown deadline too)
        preemption.close()  # last: its shutdown deadline also bounds the wait for the save
    log.close()
    xla = sharding.xla_counters()
    fallbacks = f" {xla['fallbacks']}" if xla["fallbacks"] else ""
    log.say(f"XLA: {xla['compiles']} graphs compiled ({xla['compile_seconds']:.1f}s), "
            f"{sum(xla['fallbacks'].values())} aten:: CPU fallbacks{fallbacks}, "
            f"{xla['transfers']} device-to-host transfers")
    return {"history": log.history, "evals": log.evals, "final": log.evals[-1] if log.evals else None,
            "xla": xla, "checkpoint_transfers": checkpoints.transfers, "preempted": preempted,
            "start_step": start_step}


class ConfigChangedError(ConfigError):
    pass


def refuse_changed_config(config: Config, saved: dict, identifiers: str | None) -> None:
    """Raise ConfigChangedError when the checkpoint's state says the run was made with another
    configuration in a way that matters (and run.allow_config_change is off)."""
    differences = config_differences(saved["config"], dataclasses.asdict(config))
    if saved.get("dataset_identifiers") not in (None, identifiers):
        differences.append(f"the dataset's puzzle identifiers: fingerprint {saved['dataset_identifiers']} "
                           f"in the run directory, {identifiers} now")
    if differences and not config.run.allow_config_change:
        raise ConfigChangedError(f"{config.run.dir} was created with another configuration:\n  "
                                 + "\n  ".join(differences)
                                 + "\nuse the original flags, a new --run.dir, or --run.allow-config-change")


def attempt(fn):
    """(None, fn()) or ((kind, message), None) when fn raised: kind "unreadable" for checkpoint
    contents that cannot be what was saved, "config" for a changed configuration, "stop" for
    anything else (storage failing, a state that does not match): what hosts compare."""
    try:
        return None, fn()
    except ConfigChangedError as e:
        return ("config", str(e)), None
    except checkpoint.IncompleteCheckpointError as e:
        return ("stop", str(e)), None
    except checkpoint.CheckpointError as e:
        return ("unreadable", str(e)), None
    except Exception as e:  # every host must reach the comparison, whatever failed
        return ("stop", f"{type(e).__name__}: {e}"), None


def abandon_unreadable(config: Config, unreadable: list[str], sharding, log: RunLog) -> None:
    """Every committed checkpoint is unreadable: stop, unless run.start_over says to move them
    aside (process 0) and start from step 0."""
    if not config.run.start_over:
        raise SystemExit(f"error: no committed checkpoint of {config.run.dir} can be read ("
                         + ", ".join(unreadable) + "); nothing was trained or overwritten. Pass "
                         "--run.start-over to move them aside and start from step 0, or use a new --run.dir")
    aside = storage.join_url(config.run.dir, f"checkpoints-unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
    if sharding.is_main_process():
        fs, path = storage.filesystem(storage.join_url(config.run.dir, "checkpoints"))
        storage.with_retries("moving", path, lambda: fs.mv(path, storage.filesystem(aside)[1], recursive=True))
    sharding.barrier()
    log.say(f"--run.start-over: moved the unreadable checkpoints to {aside}; starting from step 0")


def resume_or_start(config: Config, identifiers: str | None, sharding, mesh, log: RunLog):
    """(start step, Trainer, whether it resumed): the run directory's newest committed
    checkpoint, or else run.init_from's weights, or else a fresh start (which writes config.json).

    One decision for the whole slice: process 0 lists the committed checkpoints, every host reads
    the newest (its rows of the carry) and builds the training state from it, and the hosts
    compare outcomes. All resume from the same step; or all pass over a checkpoint whose
    contents are unreadable to the next older one, saying so; or all stop with an error naming
    the step, the host and the cause (storage failing beyond its retries, a checkpoint that does
    not hold this run's state, a changed configuration). A run directory whose committed
    checkpoints are all unreadable never starts over at step 0 without --run.start-over.
    """
    def listing():
        committed = checkpoint.list_checkpoints(config.run.dir)
        newest = committed[0][0] if committed else -1
        for step, url in checkpoint.list_checkpoints(config.run.dir, committed_only=False):
            if step > newest:
                log.say(f"note: passing over {url}: no {checkpoint.COMMIT_MARKER} marker (a save that did not finish)")
        return committed
    error, candidates = attempt(listing) if sharding.is_main_process() else (None, None)
    error, candidates = sharding.broadcast_object((error, candidates))
    if error:
        raise SystemExit(f"error: cannot list the checkpoints of {config.run.dir} (host 0): {error[1]}")
    def carry_rows(name, shape):  # this host's rows of the carry; every row of the puzzle table
        return sharding.rows_here(shape[0]) if name.startswith("carry/") else (0, shape[0])

    unreadable = []
    for step, url in candidates:
        def resume(url=url):
            restore, saved = checkpoint.read_checkpoint(url, carry_rows)
            refuse_changed_config(config, saved, identifiers)
            return Trainer(config, sharding, mesh, restore)
        error, trainer = attempt(resume)
        errors = {host: e for host, e in enumerate(sharding.all_gather_object(error)) if e}
        if errors and all(kind == "unreadable" for kind, _ in errors.values()):
            for host, (_, message) in errors.items():
                log.say(f"warning: passing over checkpoint step {step}, unreadable on host {host}: {message}")
            unreadable.append(url)
            continue
        if errors:
            kind, message = next(iter(errors.values()))
            if kind == "config":
                raise SystemExit(f"error: {message}")
            raise SystemExit(f"error: cannot resume from {url} (step {step}); nothing was trained or written:\n"
                             + "\n".join(f"  host {host}: {message}" for host, (_, message) in errors.items())
                             + "\nFix the cause and relaunch; the run directory is unchanged.")
        log.say(f"resuming from {url} (step {step})")
        log.config_text(config)
        return step, trainer, True
    if unreadable:
        abandon_unreadable(config, unreadable, sharding, log)
    restore = None
    if config.run.init_from:
        try:
            restore = load_initial_weights(config.run.init_from, config.model, identifiers, log.say)
        except ConfigError as e:
            raise SystemExit(f"error: {e}")
        log.say(f"initial weights from {config.run.init_from}")
    if log.main_host:
        storage.write_bytes(storage.join_url(config.run.dir, "config.json"),
                               json.dumps(dataclasses.asdict(config), indent=2).encode())
    log.config_text(config)
    return 0, Trainer(config, sharding, mesh, restore), False


class Checkpoints:
    """Saves every run.ckpt_every steps (and when asked: SIGTERM, the end), asynchronously: the
    loop pauses only for the device-to-host copy. A save first waits for the metric windows
    read so far and stops the run, without saving, if one was not finite. A failed background
    save stops the loop at the next step; `close` (in the loop's `finally`) lets a save under
    way commit, or reports it, however the loop ends."""

    def __init__(self, config: Config, trainer: Trainer, log: RunLog, identifiers: str | None, total_steps: int,
                 saved_step: int | None):
        self.config, self.trainer, self.log, self.total_steps = config, trainer, log, total_steps
        self.identifiers, self.sharding = identifiers, trainer.sharding
        self.host, self.num_hosts = self.sharding.process_index(), self.sharding.process_count()
        # One attempt id for this launch's saves, the same on every host (checkpoint.py).
        attempt = self.sharding.broadcast_object(checkpoint.new_attempt_id())
        self.writer = CheckpointWriter(config.run.dir, self.host, self.num_hosts, keep=config.run.keep_checkpoints,
                                       attempt=attempt)
        self.saved_step = saved_step  # the step whose checkpoint exists or is being written
        self.transfers = 0  # device-to-host transfers of the saves (counted apart from the loop's)

    def due(self, step: int) -> bool:
        return step % self.config.run.ckpt_every == 0 or step == self.total_steps

    def after_step(self, step: int) -> None:
        self.writer.check()  # a background save that failed stops the run now, not at the next save
        if self.due(step) and step != self.total_steps:  # the last step's save comes after the loop
            self.save(step)

    def save(self, step: int, wait: bool = False) -> None:
        """Save this step (unless its checkpoint exists or is being written already)."""
        if step != self.saved_step:
            self.log.drain()  # every host has now read the same windows, so all stop here together
            self._stop_if_not_finite()
            before = self.sharding.xla_counters()["transfers"]
            shards = self.trainer.checkpoint_shards(self.host, self.num_hosts)  # the loop's pause
            self.transfers += self.sharding.xla_counters()["transfers"] - before
            self.writer.save(step, shards, {"step": step, "config": dataclasses.asdict(self.config),
                                            "dataset_identifiers": self.identifiers})
            self.saved_step = step
        if wait:
            self.writer.wait()

    def wait(self) -> None:
        self.writer.wait()

    def close(self, error_wait_s: float = 120.0) -> None:
        """Wait for a save under way. With an exception already on its way out, wait at most
        `error_wait_s` (process 0 may be waiting for a host that is gone) and print a failed
        save rather than raise it, so that neither error hides the other."""
        leaving_on_error = sys.exc_info()[1] is not None
        if self.writer.busy():
            self.log.say(f"waiting for the checkpoint of step {self.writer.step} to be written")
        try:
            if not self.writer.wait(error_wait_s if leaving_on_error else None):
                print(f"error: the checkpoint of step {self.writer.step} is still not written after "
                      f"{error_wait_s:.0f}s (another host's part missing?): exiting without it",
                      file=sys.stderr, flush=True)
        except BaseException as e:
            if not leaving_on_error:
                raise
            print(f"error: the checkpoint of step {self.writer.step} was not saved either: {e!r}",
                  file=sys.stderr, flush=True)

    def _stop_if_not_finite(self) -> None:
        """A NaN state must never replace the last good checkpoint."""
        if self.log.nonfinite is None:
            return
        self.writer.wait()  # a save already under way holds checked steps: let it commit
        committed = checkpoint.list_checkpoints(self.config.run.dir)
        last = f"{committed[0][1]} (step {committed[0][0]})" if committed else "none yet"
        optim, dtype = self.config.optim, self.config.model.forward_dtype
        self.log.close()  # the non-finite window's record reaches metrics/ and tb/ before the exit
        raise SystemExit(
            f"error: the training loss or metrics are not finite ({self.log.nonfinite}); stopped without "
            f"saving. Last committed checkpoint: {last}; relaunching resumes from it and will likely "
            f"diverge again. Try a lower --optim.lr (now {optim.lr:g}), a longer --optim.lr-warmup-steps "
            f"(now {optim.lr_warmup_steps})"
            + ("" if dtype == "float32" else f", or --model.forward-dtype float32 (now {dtype})")
            + ", with --run.allow-config-change to continue this run directory.")


class Evaluations:
    """Evaluates at the scheduled steps (evaluation_steps) with the EMA weights, on a seeded
    subset of eval.max_examples except the final evaluation; writes {run.dir}/eval/step_N/
    (metrics.json last, as the mark of a finished evaluation) and the ARC submission. A SIGTERM
    on any host stops an evaluation between two batches (Preempted), unwritten."""

    def __init__(self, config: Config, trainer: Trainer, test_set: data.Dataset, log: RunLog, eval_steps: list[int],
                 preemption: Preemption, watchdog: Watchdog):
        self.config, self.trainer, self.test_set, self.log = config, trainer, test_set, log
        self.preemption, self.watchdog = preemption, watchdog
        self.scheduled = set(eval_steps[:-1])  # the final one runs after the loop
        self.root = storage.join_url(config.run.dir, "eval")
        self.arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None

    def after_step(self, step: int) -> None:
        if step in self.scheduled:
            self.run(step, final=False)

    def catch_up(self, start_step: int, resumed: bool) -> None:
        """A SIGTERM at an evaluation step saves and stops before evaluating: evaluate the saved
        weights now, so the run (and its ARC vote over evaluations) misses no evaluation."""
        done = storage.join_url(self.root, f"step_{start_step}", "metrics.json")
        if resumed and start_step in self.scheduled and not storage.exists(done):
            self.run(start_step, final=False)

    def run(self, step: int, final: bool) -> None:
        config, sharding = self.config, self.trainer.sharding
        started = time.time()
        index, count = sharding.data_split()
        batches = data.EvalBatches(self.test_set, config.optim.global_batch_size, process_index=index,
                                   process_count=count, max_examples=None if final else config.eval.max_examples,
                                   seed=config.run.seed)

        def between_batches(done: int) -> bool:  # True: stop (SIGTERM on some host)
            self.watchdog.progress(f"evaluation batch {done}/{len(batches)} at step {step}")
            return self.preemption.agreed_now()

        result, submission = evaluate(self.trainer, batches, sharding.sync, self.arc, self.log.say, self.root, step,
                                      config.eval.arc_aggregate, between_batches,
                                      partial(self.log.puzzles, step) if sharding.is_main_process() else None)
        if result is None:
            raise Preempted(step)
        self.log.evaluation(result, step, time.time() - started)
        if sharding.is_main_process():
            out = storage.join_url(self.root, f"step_{step}")
            if submission is not None:
                self.log.say(f"ARC submission: {write_submission(out, submission)}")
            storage.write_bytes(storage.join_url(out, "metrics.json"), json.dumps(dict(result, step=step),
                                                                                   indent=2).encode())


class ShutdownDeadline:
    """Ends the process in bounded time once asked to stop. While it watches (start() to
    close()), the first SIGTERM or SIGINT starts a clock (whoever acts on the signal, e.g.
    Preemption's save-and-stop, has `timeout_s`); when it runs out, a daemon thread prints where
    the main thread is (its stack, the training step) and exits with EXIT_RETRYABLE. A second
    signal exits at once with 128 + its number (130 Ctrl-C, 143 SIGTERM: stopped on demand).

    Signals reach it through signal.set_wakeup_fd, which the interpreter writes to from its C
    signal handler, so it works even while the main thread is stuck in native code (a hung
    collective, an XLA call) and cannot run Python signal handlers. Only signals that have a
    Python handler are seen: SIGINT always, SIGTERM while Preemption's is installed. A clock
    already running keeps running after close()."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.first: str | None = None  # the signal that started the clock

    def start(self) -> None:
        import socket

        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)  # set_wakeup_fd requires it
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="trm-shutdown-deadline")
        self._watcher.start()

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        self._write.send(b"\0")  # not a signal number: tells the watcher to stop
        self._watcher.join()
        self._read.close()
        self._write.close()

    def _watch(self) -> None:
        while (signum := self._read.recv(1)[0]) != 0:
            if signum not in (signal.SIGTERM, signal.SIGINT):
                continue
            name = signal.Signals(signum).name
            if self.first is not None:
                _say_now(f"second {name} (after {self.first}): exiting at once, without saving "
                         f"(status {128 + signum})")
                os._exit(128 + signum)
            self.first = name
            _say_now(f"{name}: stopping (saving a checkpoint first while training); if still running in "
                     f"{self.timeout_s:.0f}s (run.shutdown_timeout_s), exiting with status {EXIT_RETRYABLE}; "
                     f"another {name} exits at once")
            threading.Thread(target=self._expire, daemon=True, name="trm-shutdown-expire").start()

    def _expire(self) -> None:
        time.sleep(self.timeout_s)
        frames = sys._current_frames()
        main_frame = frames.get(threading.main_thread().ident)
        step = "unknown"
        frame = main_frame
        while frame is not None:  # the training loop's step, if training() is on the stack
            if frame.f_code is training.__code__:
                step = frame.f_locals.get("step", "none yet")
                break
            frame = frame.f_back
        lines = [f"error: still running {self.timeout_s:.0f}s after {self.first} (run.shutdown_timeout_s): "
                 f"exiting with status {EXIT_RETRYABLE}; a relaunch resumes from the last committed checkpoint. "
                 f"Training step: {step}. The main thread is at:"]
        lines += traceback.format_stack(main_frame) if main_frame is not None else ["  (not found)\n"]
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if thread is not threading.main_thread() and frame is not None \
                    and not thread.name.startswith("trm-shutdown"):
                stack = traceback.extract_stack(frame)
                ours = [f for f in stack if f.filename.startswith(PROJECT_DIR)]  # where in this project
                where = (ours or stack)[-1]
                lines.append(f"thread {thread.name}: {os.path.basename(where.filename)}:{where.lineno} "
                             f"in {where.name}\n")
        _say_now("".join(line if line.endswith("\n") else line + "\n" for line in lines))
        report.upload_now()  # the host log's last copy (object stores), bounded
        os._exit(EXIT_RETRYABLE)


def _say_now(text: str) -> None:
    """Write to stderr and the host log without Python's stream locks (which the stuck main
    thread may hold)."""
    os.write(2, (text.rstrip("\n") + "\n").encode(errors="replace"))
    report.write_now(text.rstrip("\n") + "\n")


class Preempted(Exception):
    """SIGTERM reached some host: every host stops after `step` (saving it)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


class Preemption:
    """SIGTERM (a spot VM's notice) or Ctrl-C on any host stops every host at the same step:
    hosts agree every run.preempt_check_every steps (every step on one host) and after every
    evaluation batch, and a non-finite loss seen by any host is agreed on the same way. The stop
    must end within `deadline`'s time."""

    def __init__(self, num_hosts: int, check_every: int, sharding, deadline: ShutdownDeadline | None = None):
        self.requested, self.sharding = False, sharding
        self.check_every = 1 if num_hosts == 1 else check_every
        self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        # Ctrl-C saves and stops like SIGTERM (a second one exits at once) instead of raising
        # KeyboardInterrupt wherever the main thread happens to be.
        self.previous_sigint = signal.signal(signal.SIGINT, self._on_sigterm)
        self.deadline = deadline
        if deadline:
            deadline.start()

    def _on_sigterm(self, *_) -> None:
        self.requested = True

    def agreed_stop(self, step: int, nonfinite: bool) -> bool:
        """True on every host at the same step once any host got SIGTERM or saw a NaN."""
        return step % self.check_every == 0 and self.sharding.any_host(self.requested or nonfinite)

    def agreed_now(self) -> bool:
        """True on every host once any host got SIGTERM (a collective: all hosts call it)."""
        return self.sharding.any_host(self.requested)

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)
        signal.signal(signal.SIGINT, self.previous_sigint)
        if self.deadline:
            self.deadline.close()


class Watchdog:
    """Ends this process with EXIT_RETRYABLE when nothing completes (a training step, an
    evaluation batch) for run.watchdog_minutes: a hung host or collective. It first prints what
    completed last and where the main thread waits, so that the log of every host that can
    still run says which step or collective hung; launch.sh --retry then relaunches."""

    def __init__(self, minutes: float, host: int):
        self.timeout_s, self.host = minutes * 60, host
        self.last, self.done = time.monotonic(), "the start"
        self.closed = threading.Event()
        if self.timeout_s > 0:
            threading.Thread(target=self._watch, daemon=True, name="trm-watchdog").start()

    def progress(self, done: str) -> None:
        self.last, self.done = time.monotonic(), done

    def _watch(self) -> None:
        while not self.closed.wait(min(30.0, self.timeout_s / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                frame = sys._current_frames().get(threading.main_thread().ident)
                stack = "".join(traceback.format_stack(frame)) if frame else "(unknown)\n"
                # The reason last: launch.sh quotes a host's last line.
                print(f"the main thread waits in:\n{stack}", file=sys.stderr, flush=True)
                print(f"error: host {self.host}: nothing completed for {idle / 60:.1f} min "
                      f"(--run.watchdog-minutes {self.timeout_s / 60:g}) after {self.done}: another host or a "
                      f"collective hangs; exiting with status {EXIT_RETRYABLE} (launch.sh train --retry "
                      "relaunches)", file=sys.stderr, flush=True)
                report.upload_now()  # the host log's last copy (object stores), bounded
                os._exit(EXIT_RETRYABLE)

    def close(self) -> None:
        self.closed.set()


def cli(argv: list[str] | None = None) -> Config:
    """The training configuration from the command line (a preset name, then overrides)."""
    config = tyro.extras.overridable_config_cli(PRESETS, args=argv)
    try:
        check_config(config)  # again in start(), which eval and direct callers of main() reach too
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    if config.data.path == PRESETS["demo"][1].data.path and not os.path.exists(config.data.path):
        import build_data

        print(f"building the demo dataset at {config.data.path}", flush=True)
        build_data.build_demo(config.data.path, seed=0)
    return config


def export(source: tyro.conf.Positional[str], out: str) -> None:
    """Write the EMA weights of a checkpoint as one model.safetensors (config in its metadata).

    source: a run directory (its newest readable committed checkpoint) or one checkpoint directory.
    out: where to write, local or gs:// (e.g. gs://BUCKET/models/sudoku.safetensors).
    """
    for what, value in (("the export source", source), ("--out", out)):
        try:
            storage.check_url(value, what)
        except storage.StorageError as e:
            raise SystemExit(f"error: {e}")
    try:
        found = checkpoint.weights_of(source)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    if found is None:
        raise SystemExit(f"error: {source} is not a run or checkpoint directory")
    weights, state, url = found
    checkpoint.export_model(weights, state, out)
    print(f"exported the EMA weights of {url} (step {state['step']}) to {out}", flush=True)


def config_from_dict(saved: dict) -> Config:
    return Config(data=DataConfig(**saved["data"]), model=TRMConfig(**saved["model"]),
                  optim=OptimConfig(**saved["optim"]), eval=EvalConfig(**saved["eval"]), run=RunConfig(**saved["run"]))


def load_weights_for_eval(source: str, base: Config, overrides: list[str]):
    """(config, `model/*` weights, step, fingerprint of the identifiers the weights were trained
    on or None) from a run directory or checkpoint (EMA weights and the run's config), an
    exported model.safetensors (its model config) or a reference checkpoint (the sizes its
    tensors show, the rest from the preset `base`); `overrides` (command-line flags) apply on top."""
    from model import reference_config

    def with_overrides(config: Config) -> Config:
        return tyro.cli(Config, default=config, args=overrides)

    if source.endswith(".safetensors"):
        weights, model_config, trained_on = checkpoint.read_exported(source)
        config = with_overrides(dataclasses.replace(base, model=TRMConfig(**model_config)))
        return config, {f"model/{k}": v for k, v in weights.items()}, 0, trained_on
    try:
        found = checkpoint.weights_of(source)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    if found is not None:
        ema, state, url = found
        print(f"evaluating the EMA weights of {url} (step {state['step']})", flush=True)
        weights = {f"model/{k}": v for k, v in ema.items()}
        config = with_overrides(config_from_dict(state["config"]))
        return config, weights, state["step"], state.get("dataset_identifiers")
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


@dataclass
class WeightsCommand:
    """The flags of a command that runs given weights (eval): the weights, then any setting
    of the training configuration (they override what the weights' run used)."""

    init_from: Annotated[str, tyro.conf.arg(help_behavior_hint="(required)")]
    """The weights: a run directory (its newest readable checkpoint), a checkpoint directory, an exported model.safetensors or a reference checkpoint; local or gs://."""  # noqa: E501 (one line: tyro keeps line breaks)
    config: Annotated[Config, tyro.conf.arg(name="")] = field(default_factory=Config)


def parse_weights_command(command: str, argv: list[str], description: str,
                          flags: type[WeightsCommand] = WeightsCommand) -> tuple[str, WeightsCommand, list[str]]:
    """(preset, the command's own flags parsed, the configuration flags as typed) of
    `train.py COMMAND [PRESET] ...`; tyro checks every flag and prints `--help` (exit 0). The
    configuration flags are returned unparsed: they apply on top of the weights' own run
    configuration, not of the preset."""
    preset = argv[0] if argv and argv[0] in PRESETS else "sudoku-mlp"
    rest = argv[1:] if argv and argv[0] in PRESETS else argv
    parsed = tyro.cli(flags, args=rest, default=flags("", PRESETS[preset][1]),
                      prog=f"train.py {command} [PRESET]", description=description)
    if not parsed.init_from:
        raise SystemExit(f"error: {command} needs --init-from URL (a run directory, checkpoint, exported "
                         "model.safetensors or reference checkpoint)")
    own = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(flags) if f.name != "config"}
    overrides, skip = [], False
    for arg in rest:  # every flag but the command's own (`--flag value` or `--flag=value`)
        name = arg.split("=", 1)[0].replace("_", "-")
        if skip:
            skip = False
        elif name in own:
            skip = "=" not in arg
        else:
            overrides.append(arg)
    return preset, parsed, overrides


def evaluate_command(argv: list[str]) -> dict:
    """`python train.py eval [PRESET] --init-from URL --data.path URL [overrides]`: evaluate a
    run directory / checkpoint, an exported model.safetensors or a reference checkpoint on a
    dataset's test split; prints and saves the metrics (and ARC scores) under
    {run.dir}/eval/step_N/."""
    preset, flags, args = parse_weights_command("eval", argv, "Evaluate " + " ".join(
        evaluate_command.__doc__.split(":", 1)[1].split()).removeprefix("evaluate "))
    source = flags.init_from
    try:
        storage.check_url(source, "--init-from")
    except storage.StorageError as e:
        raise SystemExit(f"error: {e}")
    config, weights, step, trained_on = load_weights_for_eval(source, PRESETS[preset][1], args)
    table = weights.get("model/puzzle_embedding.weight")
    config, _, test_set, sharding, device_kind, _ = start(config, None if table is None else table.shape[0],
                                                          trained_on, source)
    data_index, data_count = sharding.data_split()
    say = print if sharding.is_main_process() else (lambda *a, **k: None)
    mesh = sharding.data_mesh()
    trainer = Trainer(config, sharding, mesh, weights)
    batches = data.EvalBatches(test_set, config.optim.global_batch_size, process_index=data_index,
                               process_count=data_count,
                               max_examples=config.eval.max_examples, seed=config.run.seed)
    trainer.init_carries(sharding.host_batch_to_global(batches.batch(0), mesh))
    sharding.sync()
    say(f"evaluating {source} (step {step}) on {batches.num_examples} examples of {config.data.path} "
        f"on {device_kind} ({len(batches)} batches)", flush=True)
    started = time.time()
    arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None
    result, submission = evaluate(trainer, batches, sharding.sync, arc, lambda *a: say(*a, flush=True),
                                  storage.join_url(config.run.dir, "eval"), step, config.eval.arc_aggregate)
    out = storage.join_url(config.run.dir, "eval", f"step_{step}")
    if sharding.is_main_process():
        metrics = json.dumps(dict(result, source=source), indent=2).encode()
        storage.write_bytes(storage.join_url(out, "metrics.json"), metrics)
        if submission is not None:
            write_submission(out, submission)
    scores = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
                       if k not in ("count", "num_examples"))
    say(f"eval of {source}: {scores}  ({time.time() - started:.0f}s); saved to {out}", flush=True)
    return result


def usage() -> str:
    """`python train.py --help`: the presets and the commands."""
    width = max(map(len, PRESETS))
    return "\n".join([
        "usage: python train.py PRESET [FLAGS]                          train (PRESET --help: every flag)",
        "       python train.py eval [PRESET] --init-from URL [FLAGS]   evaluate weights on a test split",
        "       python train.py export SOURCE --out URL                 the EMA weights as one safetensors file",
        "       python train.py predict [PRESET] --init-from URL ...    answers to --puzzle / --puzzle-file / --task",
        "", "presets:", *(f"  {name.ljust(width)}  {about}" for name, (about, _) in PRESETS.items()),
        "", "Each command's --help lists its flags; flags take `--flag value` or `--flag=value`."])


def command_line(argv: list[str]) -> int:
    """Run a command; the exit status: 0 done (or saved and stopped on SIGTERM), 1 a failure a
    relaunch would repeat, EXIT_RETRYABLE one it may not (storage failing beyond its retries, a
    lost peer host; the watchdog exits with it too)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        if argv[:1] == ["export"]:
            tyro.cli(export, args=argv[1:], prog="train.py export")
            return 0
        if argv[:1] == ["predict"]:
            import predict  # its own file; it imports this one

            predict.predict_command(argv[1:])
            return 0
        if argv[:1] == ["eval"]:
            evaluate_command(argv[1:])
            return 0
        result = main(cli(argv), argv[0] if argv[0] in PRESETS else None)
        return 0 if result["final"] is not None or result["preempted"] else 1
    except storage.StorageError as e:
        print(f"error: {e}\nStorage failed beyond its retries; relaunching may help (exit status {EXIT_RETRYABLE}).",
              file=sys.stderr, flush=True)
        return EXIT_RETRYABLE
    except RuntimeError as e:
        sharding = sys.modules.get("sharding")  # imported by start(): it brings torch_xla
        if sharding is None or not isinstance(e, sharding.HostLostError):
            raise
        print(f"error: the connection to another host broke ({e}); that host was most likely lost or "
              f"preempted: relaunch the slice (exit status {EXIT_RETRYABLE}).", file=sys.stderr, flush=True)
        return EXIT_RETRYABLE


if __name__ == "__main__":
    sys.modules.setdefault("train", sys.modules[__name__])  # `import train` (predict.py) finds this module
    sys.exit(command_line(sys.argv[1:]))
