"""The training configuration: the dataclasses users change with flags (one docstring line per
field, which `--help` shows), the presets (the paper's recipes and the CPU demo), and everything
about a configuration that needs neither a dataset nor a device: the range and URL checks, the
settings lines printed at start, the fingerprint hosts compare, which fields a resume may
change, and the command-line parser (`parse`).

    python train.py --help               # the presets
    python train.py arc1 --help          # every field with the preset's value
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

import tyro

from model import TRMConfig
from modeling.field_ranges import range_problems, ranged
from modeling.schemes import SCHEMES, arch_defaults
from rundir import storage
from testtime import batches as testtime_batches
from testtime import settings as testtime_settings

if TYPE_CHECKING:
    import data

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: train.py and the packages
DenseOptimizer = Literal["adam_atan2", "adamw", "adam", "muon"]
DENSE_OPTIMIZERS = get_args(DenseOptimizer)
"""The dense weights' optimizers (training/optim.py's dense_optimizer builds each; a test checks the two agree)."""
LR_SCHEDULES = ("cosine", "linear", "constant")
"""The learning rate's shape after warmup (schedule.lr_at)."""


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
    optimizer: DenseOptimizer = "adam_atan2"
    """Optimizer of the dense weights: adam_atan2 (the paper's), torch's adamw or adam (eps 1e-8), or URM's muon (2-D weights; the rest by its AdamW)."""  # noqa: E501 (one line: tyro keeps line breaks)
    lr: float = ranged(1e-4, ge=0)
    """Peak learning rate of the dense weights' optimizer."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """The learning rate after warmup: cosine or linear from lr down to lr_min_ratio·lr, or constant lr."""
    lr_min_ratio: float = ranged(1.0, ge=0, le=1, note="a fraction of the peak lr")
    """Floor of the cosine or linear decay as a fraction of lr (1.0: constant after warmup, as in the paper)."""
    lr_warmup_steps: int = ranged(2000, ge=0)
    """Linear warmup steps from 0."""
    beta1: float = ranged(0.9, ge=0, le=_BETA_MAX, note=_BETA_NOTE)
    """beta1 of the dense weights' optimizer."""
    beta2: float = ranged(0.95, ge=0, le=_BETA_MAX, note=_BETA_NOTE)
    """beta2 of the dense weights' optimizer."""
    weight_decay: float = ranged(1.0, ge=0)
    """Weight decay of the dense weights (decoupled for adam_atan2 and adamw; added to the gradient for adam)."""
    puzzle_emb_lr: float = ranged(1e-4, ge=0)
    """Peak learning rate of the puzzle-embedding SignSGD (same schedule)."""
    puzzle_emb_weight_decay: float = ranged(1.0, ge=0)
    """Decoupled weight decay of the puzzle embedding."""
    ema_rate: float = ranged(0.999, ge=0, lt=1, note="0 evaluates the trained weights as they are")
    """EMA rate of the weights used for evaluation and export."""
    curriculum_epochs: int = ranged(0, ge=0, note="0 = off")
    """Recursion curriculum (schedule.py): cycles grow from the start values to the model's over these epochs."""
    curriculum_start_H_cycles: int = ranged(1, ge=1)
    """H_cycles at the curriculum's start (at most model.H_cycles)."""
    curriculum_start_L_cycles: int = ranged(2, ge=1)
    """L_cycles at the curriculum's start (at most model.L_cycles)."""


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
    trajectories: str = resumable("1")
    """Test-time scaling (testtime/noisy_trajectories.py, docs/test-time-scaling.md): K noisy trajectories per puzzle (any K up to the batch), scored by best-Q, mode@K and pass@K; `train.py eval` takes a comma list (1,4,16) and writes one {run.dir}/test-time/ setting each, training's evaluations use the last K."""  # noqa: E501 (one line: tyro keeps line breaks)
    noise: str = resumable("0")
    """Standard deviation of the Gaussian noise added to the latent (eval.noise_latent) at every ACT step of each trajectory; `train.py eval` takes a comma list (0.1,0.3), training's evaluations use the last."""  # noqa: E501
    act_steps: int | None = resumable(None, ge=1, note="leave it out for the model's halt_max_steps")
    """D, the ACT steps each evaluation runs per puzzle (test-time depth); None: model.halt_max_steps, the reference's evaluation. Beyond it the recursion goes on from the carry."""  # noqa: E501
    noise_latent: Literal["z_L", "z_H", "both"] = resumable("z_L")
    """Where test-time noise enters at every ACT step: z_L (the low-level latent), z_H, or both."""
    convergence_window: int = resumable(3, ge=0)
    """With trajectories, the convergence residual (EqR's conv selection, conv_exact_accuracy) averages the logits' change over the last this many ACT steps; 0 or at least D - 1: all D - 1 changes."""  # noqa: E501
    convergence_top_k: int = resumable(1, ge=1)
    """With trajectories, conv_top_k_exact_accuracy is the exact fraction of the answers of the k trajectories with the lowest convergence residuals (EqR's convergence_top_k; at most K)."""  # noqa: E501


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
    compile_cache_dir: str | None = resumable(None)
    """XLA's persistent compilation cache on each TPU host. None: ~/.cache/trm-xla where torch_xla can load it; off on torch_xla 2.9, which cannot on a TPU (pytorch/xla#9094): a directory turns it on anyway."""  # noqa: E501 (one line: tyro keeps line breaks)
    compile_cache_url: str | None = resumable(None)
    """Also keep the cache's files under {this}/{key}/ (key: accelerator type, torch_xla and libtpu versions, code hash) for a new VM: restored before the runtime starts, new files uploaded by process 0. Off by default: torch_xla 2.9 cannot load them on a TPU (pytorch/xla#9094)."""  # noqa: E501
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
class ReportConfig:
    wandb_project: str | None = resumable(None)
    """Also mirror the run to this Weights & Biases project (process 0; needs `pip install wandb`; WANDB_MODE=offline honoured): docs/watching-a-run.md."""  # noqa: E501 (one line: tyro keeps line breaks)
    wandb_entity: str | None = resumable(None)
    """The W&B entity (user or team) of the project; None: the API key's default entity."""
    wandb_name: str | None = resumable(None)
    """The W&B run's display name; None: the run directory's last part."""
    wandb_group: str | None = resumable(None)
    """The W&B group of the run (`study.py run` sets the study's name)."""
    wandb_tags: tuple[str, ...] = resumable(())
    """W&B tags of the run (`study.py run` adds the run's configuration name)."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: TRMConfig = field(default_factory=lambda: TRMConfig(mlp_t=True, pos_encodings="none"))
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    report: ReportConfig = field(default_factory=ReportConfig)


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


# EqR's recipes (github.com/locuslab/EqR @ 4d45856, config/train/eqr_*.yaml with config/arch/eqr.yaml;
# arXiv 2605.21488): global batch 768, AdamATan2 lr 1e-4 (2000 warmup steps, then constant), betas
# (0.9, 0.95), weight decay 1.0, EMA 0.999, bf16, seed 0; no puzzle embedding. Its pretrain.py counts
# floor(1000 examples / 768) = 1 step per epoch, so its 50,000 (Maze: 100,000) epochs are 50,000
# (100,000) steps, evaluated every 5,000 steps; we count an epoch as the TRM reference does (1000/768
# steps), so the same steps are 50,000 * 768 / 1000 = 38,400 epochs (76,800), evaluated every 3,840.
_EQR_STEP_EPOCHS = 768 / 1000  # our epochs per EqR step on its 1000-example training sets
_eqr = dict(optim=dict(epochs=round(50000 * _EQR_STEP_EPOCHS)), eval=dict(every_epochs=round(5000 * _EQR_STEP_EPOCHS)))
_eqr_sudoku = _preset(model=dict(arch_defaults("eqr"), mlp_t=True, pos_encodings="none"), **_eqr)
_eqr_maze = _preset(data=dict(path="data/maze-30x30-unique-1k"),
                    model=dict(arch_defaults("eqr"), seq_len=900, vocab_size=6, hidden_size=128, num_heads=8,
                               L_layers=1, L_cycles=4, mlp_t=False, pos_encodings="rope"),
                    optim=dict(epochs=round(100000 * _EQR_STEP_EPOCHS)), eval=_eqr["eval"])
# URM (github.com/UbiquantAI/URM @ 41de2c3): its scripts/URM_*.sh run `pretrain.py arch=urm arch.loops=16
# arch.H_cycles=2 arch.L_cycles=6 arch.num_layers=4 eval_interval=2000 +ema=True` over config/cfg_pretrain.yaml
# (global batch 768, lr 1e-4 after 2000 warmup steps then constant, betas (0.9, 0.95), EMA 0.999) and
# urm.yaml (hidden 512, 8 heads, expansion 4, a puzzle embedding of 512 on one position), in bfloat16.
_urm_model = dict(arch_defaults("urm"), H_cycles=2, L_cycles=6, L_layers=4, halt_max_steps=16)
_urm_arc = _preset(_arc, model=_urm_model, optim=dict(epochs=200000), eval=dict(every_epochs=2000))


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
    # EqR (see _eqr above). Sudoku: eqr_sudoku.yaml's mlp_t, H 3, L 6, 2 layers, width 512, 16 ACT
    # steps (its pos_encodings rope is unused by mlp_t blocks: none here, the same model).
    "eqr-sudoku": ("Sudoku-Extreme, EqR with mlp_t (EqR's config/train/eqr_sudoku.yaml; its paper: 99.56% exact "
                   "at depth 64 x breadth 128)", _eqr_sudoku),
    # Maze: eqr_maze_unique.yaml's 1 layer, L 4, width 128, 8 heads, 1-D rope, 100,000 EqR epochs, on its
    # Maze-Unique (perfect 30x30 mazes generated locally), at data/maze-30x30-unique-1k as EqR names it:
    # `python build_data.py build-maze-unique --out data/maze-30x30-unique-1k` (the defaults are EqR's recipe;
    # maze for maze what its dataset/build_maze_unique_dataset.py writes, puzzles/maze_unique.py).
    "eqr-maze": ("Maze-Unique 30x30 (build_data.py build-maze-unique), EqR with attention (EqR's "
                 "config/train/eqr_maze_unique.yaml; its README "
                 "gives no number, the paper was not read here)", _eqr_maze),
    "urm-arc1": ("ARC-AGI-1, URM (scripts/URM_arcagi1.sh; its README: 53.8% pass@1)", _urm_arc),
    "urm-arc2": ("ARC-AGI-2, URM with its Muon (scripts/URM_arcagi2.sh; its README: 16.0% pass@1)",
                 _preset(_urm_arc, data=dict(path="data/arc2concept-aug-1000"), optim=dict(optimizer="muon"))),
    "urm-sudoku": ("Sudoku-Extreme, URM, ARC's architecture (scripts/URM_sudoku.sh; its paper: 77.6%)",
                   _preset(model=_urm_model, optim=dict(global_batch_size=128), eval=dict(every_epochs=2000))),
    # The demo keeps the presets' bfloat16 activations, so the first command users run takes the
    # numerics of the real runs (its accuracy and cost against float32: docs/measurements.md).
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


def arch_in(argv: list[str]) -> str | None:
    """The value of the last --model.arch flag in argv (None if none, or not an arch)."""
    found = None
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name.replace("_", "-") == "--model.arch":
            found = value if value else (argv[i + 1] if i + 1 < len(argv) else None)
    return found if found in SCHEMES else None


def with_arch(config: Config, arch: str | None) -> Config:
    """`config` with the model of arch `arch`: its reference yaml's values where they differ from
    trm.yaml's (the presets were built on it: HRM's cycles and layers, the baseline's 8 layers of 12
    heads) and what its reference file fixes (schemes.RecursionScheme.forced); every other field, e.g. a
    preset's mlp_t or seq_len, stays. None or the config's own arch: the config as it is."""
    if arch is None or arch == config.model.arch:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **arch_defaults(arch)))


def presets_for(argv: list[str]) -> dict[str, tuple[str, Config]]:
    """PRESETS with the arch that argv's --model.arch names, so that flags apply on top of that
    arch's values and --help shows them."""
    arch = arch_in(argv)
    return {name: (about, with_arch(preset, arch)) for name, (about, preset) in PRESETS.items()}


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
    for name, value, choices in (("optim.optimizer", config.optim.optimizer, DENSE_OPTIMIZERS),
                                 ("optim.lr_schedule", config.optim.lr_schedule, LR_SCHEDULES)):
        if value not in choices:
            problems.append(f"{name}={value!r} must be one of {', '.join(choices)} (set it with {flag(name)})")
    # Each K must parse and fit the global batch (the puzzles' rows padded, any K); each noise must parse.
    checks = (("eval.trajectories", lambda text: [testtime_batches.host_puzzles(config.optim.global_batch_size, k, 1)
                                                  for k in testtime_settings.parse_trajectories(text)]),
              ("eval.noise", testtime_settings.parse_noises))
    for name, check in checks:
        try:
            check(getattr(config.eval, name.split(".")[1]))
        except ValueError as e:
            problems.append(f"{e} (set it with {flag(name)})")
    for level in ("H", "L") if config.optim.curriculum_epochs else ():
        start, end = getattr(config.optim, f"curriculum_start_{level}_cycles"), getattr(config.model, f"{level}_cycles")
        if start > end:
            problems.append(f"optim.curriculum_start_{level}_cycles={start} exceeds model.{level}_cycles={end}, "
                            f"where the curriculum ends: lower {flag(f'optim.curriculum_start_{level}_cycles')}")
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
    if config.report.wandb_project and importlib.util.find_spec("wandb") is None:
        problems.append("report.wandb_project mirrors the run to Weights & Biases, which needs the wandb package: "
                        "pip install wandb (or leave out --report.wandb-project)")
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
    """How to set a field on the command line: --optim.lr 0.001, --eval.arc / --eval.no-arc,
    --report.wandb-tags a b."""
    if isinstance(value, bool):
        section, _, field_name = name.rpartition(".")
        return flag(f"{section}.{'' if value else 'no_'}{field_name}")
    import shlex

    values = value if isinstance(value, (tuple, list)) else (value,)
    return " ".join([flag(name), *(shlex.quote(str(v)) for v in values)])


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


def config_fingerprint(config: Config) -> str:
    """Text that differs whenever the flags or the code differ (compared across hosts): the
    config and a hash of every Python file of the project that a run executes."""
    sources = []
    for name in sorted(n for n in os.listdir(PROJECT_DIR) if n.endswith(".py")):
        with open(os.path.join(PROJECT_DIR, name), "rb") as f:
            sources.append(f"{name}:{hashlib.sha256(f.read()).hexdigest()}")
    return json.dumps(dataclasses.asdict(config), sort_keys=True) + "\n" + "\n".join(sources)


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


def with_new_fields(saved: dict) -> dict:
    """A configuration saved as a dict (config.json, a checkpoint's state) with every field (and
    section) added to the dataclasses since then, at its default: what the code that saved it did
    (e.g. optim.optimizer adam_atan2, optim.lr_schedule cosine, no report.wandb_project)."""
    defaults = dataclasses.asdict(Config())
    return {**{section: values for section, values in defaults.items() if section not in saved},
            **{section: {**defaults.get(section, {}), **values} if isinstance(values, dict) else values
               for section, values in saved.items()}}


def config_from_dict(saved: dict) -> Config:
    return Config(data=DataConfig(**saved["data"]), model=TRMConfig(**saved["model"]),
                  optim=OptimConfig(**saved["optim"]), eval=EvalConfig(**saved["eval"]), run=RunConfig(**saved["run"]),
                  report=ReportConfig(**{k: tuple(v) if isinstance(v, list) else v
                                         for k, v in saved.get("report", {}).items()}))


def reads_demo_data(config: Config) -> bool:
    """Whether a run reads the demo preset's dataset where the demo builds it (train.py and a
    study build it there first, if it is missing)."""
    return config.data.path == PRESETS["demo"][1].data.path


def parse_config(argv: list[str] | None = None) -> Config:
    """The training configuration from the command line (a preset name, then overrides)."""
    argv = sys.argv[1:] if argv is None else argv
    config = tyro.extras.overridable_config_cli(presets_for(argv), args=argv)
    try:
        check_config(config)  # again in start(), which eval and direct callers of main() reach too
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    return config
