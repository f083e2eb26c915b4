"""Test-time scaling by noisy parallel trajectories chosen by the model's own Q-halt head
(Probabilistic TRM, Sghaier, Parviz and Jolicoeur-Martineau, arXiv 2605.19943), on a trained
model and without retraining: `train.py eval --eval.trajectories 1,4,16 --eval.noise 0.3`.

Each test puzzle runs as K rows of the one evaluation batch (static shapes: a batch holds
optim.global_batch_size // K puzzles, each repeated K times, puzzle-major, and is split over the
mesh like any batch). At every ACT step (the TRM paper's "deep recursion", one call of the H/L
recursion) Gaussian noise of scale sigma is added to the latent z_L of every trajectory, through
the `perturb` hook of TRM.forward. After every ACT step each puzzle takes the answer of its
trajectory with the highest q_halt logit (ties: the lowest trajectory index); evaluation runs
exactly halt_max_steps ACT steps, so the answer scored is the one chosen by the Q of the last.

The noise is a pure function of (run.seed, the puzzle, the trajectory, the ACT step, the
element): a counter-based hash (as model.hashed_uniform), identical on CPU and XLA whatever the
device count or batch layout. The puzzle is named by a hash of its input tokens and puzzle
identifier, so it needs no extra batch field. Trajectory k draws the same noise at every K, so
the trajectories of K=4 are the first four of K=16. K=1 without noise is not routed here at all:
it is today's evaluation, bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import torch

from model import IGNORE_LABEL_ID, Carry

MASK = 0xFFFFFFFF
EXTRA_METRICS = ("oracle_exact_accuracy",)
"""What the evaluation step sums besides trainer.EVAL_METRICS with trajectories: the puzzles
that any of their K trajectories solves (what a perfect selector would score)."""
CURVE_FILE, CURVE_PLOT = "trajectories.json", "trajectories.png"


def parse_trajectories(text: str) -> list[int]:
    """[K, ...] of --eval.trajectories: one count or a comma list such as 1,4,16 (each >= 1)."""
    try:
        ks = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        ks = []
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"eval.trajectories={text!r} must be one count or a comma list of counts >= 1 "
                         "(e.g. --eval.trajectories 1,4,16)")
    return ks


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche of the low 32 bits of int64 `x` (xorshift-multiply rounds)."""
    x = x & MASK
    for multiplier in (0x7FEB352D, 0x4C8E9CF5, 0x2C1B3C6D):
        x = ((x ^ (x >> 16)) * multiplier) & MASK
    return x ^ (x >> 16)


def puzzle_keys(inputs: torch.Tensor, puzzle_identifiers: torch.Tensor) -> torch.Tensor:
    """[rows] int64: a 32-bit hash of each row's input tokens (with their positions) and puzzle
    identifier; the same puzzle gets the same key in any batch, on any device."""
    positions = torch.arange(inputs.shape[1], device=inputs.device, dtype=torch.int64)
    tokens = mix32(inputs.to(torch.int64) * 0x9E3779B1 + positions * 0x85EBCA77 + 0x165667B1)
    return mix32(tokens.sum(-1) + puzzle_identifiers.to(torch.int64) * 0x27D4EB2F)


def _int32(value: int) -> int:
    """The int32 of a 32-bit pattern (a multiplier above 2**31 as its negative twin)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int32 bit patterns. Shifted only while non-negative: torch_xla
    rounds `>>` of a negative int32 toward zero, as a division (-5 >> 16 is 0 there, -1 on CPU)."""
    return ((x & 0x7FFFFFFF) >> bits) | torch.where(x < 0, 1 << (31 - bits), 0).to(torch.int32)


def _mix_int32(x: torch.Tensor) -> torch.Tensor:
    """mix32 in int32 arithmetic, whose products wrap modulo 2**32 on CPU and XLA alike (the same
    bits as mix32 without int64, which a TPU emulates): for the noise's one hash per element."""
    for multiplier in (0x7FEB352D, 0x4C8E9CF5, 0x2C1B3C6D):
        x = (x ^ _shift_right(x, 16)) * multiplier
    return x ^ _shift_right(x, 16)


def hashed_normal(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 [rows, *shape]: element i of row r is a pure function of
    (keys[r], i), by Box-Muller on two 24-bit uniforms hashed from them."""
    count = math.prod(shape)
    elements = torch.arange(0, 2 * count, 2, device=keys.device, dtype=torch.int32).view(1, *shape)
    key = mix32(keys)
    key = torch.where(key >= 1 << 31, key - (1 << 32), key).to(torch.int32)  # the same bits, as int32
    base = key.view(-1, *([1] * len(shape))) * _int32(0x632BE5AB) + elements
    u1 = (_shift_right(_mix_int32(base), 8) + 1).to(torch.float32) * (1.0 / (1 << 24))  # (0, 1]
    u2 = _shift_right(_mix_int32(base + 1), 8).to(torch.float32) * (1.0 / (1 << 24))  # [0, 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """K noisy trajectories per puzzle: `perturb` is TRM.forward's hook, `select` keeps each
    puzzle's best trajectory. Rows are puzzle-major: row r is trajectory r % K of puzzle r // K."""

    count: int
    """K, trajectories per puzzle."""
    noise: float
    """sigma: the standard deviation of the Gaussian noise added to z_L at every ACT step."""
    seed: int = 0
    """run.seed: the same seed, the same noise."""

    def keys(self, data: dict[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """[rows] int64: the noise key of (seed, puzzle, trajectory, ACT step) of each row."""
        rows = torch.arange(steps.shape[0], device=steps.device, dtype=torch.int64)
        key = mix32(puzzle_keys(data["inputs"], data["puzzle_identifiers"]) + self.seed * 0x9E3779B1)
        key = mix32(key + (rows % self.count) * 0x85EBCA77)
        return mix32(key + steps.to(torch.int64) * 0xC2B2AE3D)

    def perturb(self, z_L: torch.Tensor, data: dict[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """z_L + sigma * N(0, I), drawn per (seed, puzzle, trajectory, ACT step `steps`)."""
        if self.noise == 0:
            return z_L
        noise = hashed_normal(self.keys(data, steps), tuple(z_L.shape[1:]))
        return (z_L.float() + self.noise * noise).to(z_L.dtype)

    def best(self, q_halt: torch.Tensor) -> torch.Tensor:
        """Bool [rows]: the row is its puzzle's chosen trajectory, the first of those with the
        highest q_halt logit."""
        k = self.count
        q = q_halt.view(-1, k)
        index = torch.arange(k, device=q.device)
        first = torch.where(q == q.max(1, keepdim=True).values, index, k).min(1, keepdim=True).values
        return (index == first).view(-1)

    def solved_by_any(self, carry: Carry, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 []: the counted puzzles (halted, with labels) that one of their trajectories
        answers exactly (the oracle's exact accuracy, times the count)."""
        labels = carry.current_data["labels"]
        valid = labels != IGNORE_LABEL_ID
        solved = (valid & (outputs["logits"].argmax(-1) == labels)).sum(-1) == valid.sum(-1)
        counted = carry.halted & (valid.sum(-1) > 0)
        return (counted & solved).view(-1, self.count).any(1).sum().float()

    def select(self, carry: Carry, outputs: dict[str, torch.Tensor]) -> tuple[Carry, dict[str, torch.Tensor]]:
        """(carry, outputs) with every row holding its puzzle's chosen trajectory's logits and
        q_halt, and only the puzzle's first row halted (counted by loss_and_metrics): the
        metrics are those of the chosen answers, one per puzzle, and the shapes stay."""
        k, chosen = self.count, self.best(outputs["q_halt_logits"])

        def spread(t: torch.Tensor) -> torch.Tensor:  # the chosen row's value on its puzzle's K rows
            mask = chosen.view(-1, k, *([1] * (t.ndim - 1)))
            picked = torch.where(mask, t.view(-1, k, *t.shape[1:]), torch.zeros((), dtype=t.dtype, device=t.device))
            return picked.sum(1, keepdim=True, dtype=t.dtype).expand(-1, k, *t.shape[1:]).reshape(t.shape)

        first = torch.arange(chosen.shape[0], device=chosen.device) % k == 0
        selected = {"logits": spread(outputs["logits"]), "q_halt_logits": spread(outputs["q_halt_logits"])}
        return dataclasses.replace(carry, halted=carry.halted & first), selected


def parse_noises(text: str) -> list[float]:
    """[sigma, ...] of --eval.noise: one scale or a comma list such as 0,0.3 (each >= 0)."""
    try:
        noises = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        noises = []
    if not noises or any(not math.isfinite(n) or n < 0 for n in noises):
        raise ValueError(f"eval.noise={text!r} must be one scale or a comma list of scales >= 0 "
                         "(e.g. --eval.noise 0.3)")
    return noises


def training_trajectories(eval_config) -> tuple[int, float]:
    """(K, noise) of a training run's evaluations, and of the evaluation program tpu_compile.py
    compiles: the last of eval.trajectories and of eval.noise (config.EvalConfig)."""
    return parse_trajectories(eval_config.trajectories)[-1], parse_noises(eval_config.noise)[-1]


def trajectories_of(k: int, noise: float, seed: int) -> Trajectories | None:
    """What Trainer.set_trajectories takes for K and sigma: None (the reference's evaluation,
    untouched) for one trajectory without noise."""
    return None if k == 1 and noise == 0 else Trajectories(k, noise, seed)


def repeat_rows(batch: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """Each row of a host batch K times in a row (puzzle-major trajectories)."""
    return batch if k == 1 else {name: np.repeat(rows, k, axis=0) for name, rows in batch.items()}


class TrajectoryBatches:
    """EvalBatches of global_batch_size // K puzzles per batch, each puzzle's row repeated K
    times: batches of global_batch_size rows, the shape of every evaluation batch."""

    def __init__(self, puzzles, k: int):
        self.puzzles, self.k = puzzles, k

    @property
    def num_examples(self) -> int:
        return self.puzzles.num_examples

    def __len__(self) -> int:
        return len(self.puzzles)

    def valid(self, index: int) -> np.ndarray:
        return np.repeat(self.puzzles.valid(index), self.k)

    def batch(self, index: int) -> dict:
        return repeat_rows(self.puzzles.batch(index), self.k)


def eval_batches(test_set, global_batch_size: int, k: int, process_index: int = 0, process_count: int = 1,
                 max_examples: int | None = None, seed: int = 0):
    """The evaluation batches at K trajectories (EvalBatches itself at K=1)."""
    from batches import EvalBatches

    puzzles = EvalBatches(test_set, puzzles_per_batch(global_batch_size, k, process_count),
                          process_index=process_index, process_count=process_count,
                          max_examples=max_examples, seed=seed)
    return puzzles if k == 1 else TrajectoryBatches(puzzles, k)


def puzzles_per_batch(global_batch_size: int, k: int, process_count: int) -> int:
    """Puzzles per evaluation batch at K trajectories: global_batch_size // K, as long as every
    host's rows hold whole puzzles."""
    if global_batch_size % (k * process_count):
        fits = [d for d in range(1, global_batch_size + 1) if global_batch_size % (d * process_count) == 0]
        raise ValueError(f"eval.trajectories K={k} must divide the global batch of {global_batch_size} rows "
                         f"over {process_count} host(s) into whole puzzles: pick K among {fits} or change "
                         "--optim.global-batch-size")
    return global_batch_size // k


def write_curve(out_dir: str, rows: list[dict], title: str) -> tuple[str, str]:
    """Save the accuracy-vs-K rows as trajectories.json and draw trajectories.png in out_dir;
    returns both URLs."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import storage

    json_url, png_url = storage.join_url(out_dir, CURVE_FILE), storage.join_url(out_dir, CURVE_PLOT)
    storage.write_bytes(json_url, json.dumps(rows, indent=2).encode())
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for r in rows:
        if r["noise"] == 0:  # the evaluation without noise, as a level
            ax.axhline(100 * r["exact_accuracy"], color="gray", linestyle="--", linewidth=1,
                       label=f"K={r['trajectories']}, no noise")
    for noise in sorted({r["noise"] for r in rows} - {0}):
        line = sorted((r for r in rows if r["noise"] == noise), key=lambda r: r["trajectories"])
        drawn = ax.plot([r["trajectories"] for r in line], [100 * r["exact_accuracy"] for r in line], "o-",
                        label=f"noise {noise:g}: highest q_halt")
        ax.plot([r["trajectories"] for r in line], [100 * r["oracle_exact_accuracy"] for r in line], ":",
                color=drawn[0].get_color(), label=f"noise {noise:g}: any trajectory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("trajectories per puzzle (K)")
    ax.set_ylabel("exact accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    storage.write_bytes(png_url, buffer.getvalue())
    return json_url, png_url


def curve_table(rows: list[dict]) -> str:
    """The rows as the lines eval prints."""
    lines = ["  K  noise  exact_acc  any_exact  accuracy  wall s/puzzle  CPU s/puzzle   (any_exact: some trajectory "
             "solves it; times: the batches after the first, which compiles)"]
    for r in rows:
        lines.append(f"{r['trajectories']:>3}  {r['noise']:>5g}  {r['exact_accuracy']:>9.4f}  "
                     f"{r['oracle_exact_accuracy']:>9.4f}  {r['accuracy']:>8.4f}  "
                     f"{r['seconds_per_puzzle']:>13.5f}  {r['cpu_seconds_per_puzzle']:>12.5f}")
    return "\n".join(lines)


def saved_curve_columns(run_dir: str) -> dict[str, str]:
    """The study report's columns of a run evaluated at several K (`train.py eval --init-from RUN
    --run.dir RUN --eval.trajectories ...`): exact accuracy in % of each (K, noise) of the newest
    eval/step_N/trajectories.json under run_dir, as {"exact_K16_noise0.3_%": "57.00"}; empty if none."""
    import re

    import storage

    fs, path = storage.filesystem(storage.join_url(run_dir, "eval"))
    try:
        found = fs.glob(f"{path.rstrip('/')}/step_*/{CURVE_FILE}")
    except FileNotFoundError:
        return {}
    steps = sorted((int(m.group(1)), f) for f in found if (m := re.search(r"step_(\d+)/", f)))
    if not steps:
        return {}
    rows = json.loads(storage.read_bytes(storage.join_url(run_dir, "eval", f"step_{steps[-1][0]}", CURVE_FILE)))
    return {f"exact_K{r['trajectories']}_noise{r['noise']:g}_%": f"{100 * r['exact_accuracy']:.2f}" for r in rows}
