"""Test-time scaling by noisy parallel trajectories (Probabilistic TRM, Sghaier, Parviz and
Jolicoeur-Martineau, arXiv 2605.19943) on the device: the noise added to the latent at every ACT
step, and the three ways the paper picks one answer among a puzzle's K trajectories. Which
settings run and where their results go: testtime/settings.py; the batches: testtime/batches.py.

Rows. Each host's part of an evaluation batch (host_rows rows; the whole batch on one host) holds
P = host_rows // K puzzles, each as K rows in a row (puzzle-major), then host_rows - P*K padding
rows, which count nowhere. K need not divide the batch: the layout is static, so one program
serves every batch.

Noise. At every ACT step (the TRM paper's "deep recursion", one call of the H/L recursion)
Gaussian noise of scale sigma is added to the latent (`latent`: z_L, as the replications that
perturb the low-level state do; z_H; or both) of every trajectory, through the `perturb` hook of
TRM.forward. It is a pure function of (run.seed, the puzzle, the trajectory, the ACT step, the
element), by the counter hash (modeling/counter_hash.py): identical on CPU and XLA whatever the device
count or batch layout. The puzzle is named by a hash of its input tokens and puzzle identifier.
Trajectory k draws the same noise at every K, so the trajectories of K=4 are the first four of
K=16.

Selection, after every ACT step (the answer scored is the one chosen at the last, step D):
- best-Q: the trajectory that the arch's halting rule most wants to halt (TRMConfig.halt_score:
  q_halt, or q_halt - q_continue for archs that halt on q_halt > q_continue); ties: the lowest
  trajectory index. Its answer gives the evaluation's usual metrics (exact_accuracy, accuracy...).
- mode@K: the most frequent answer among the K, an answer being the predicted tokens on the
  labelled cells (labels != IGNORE_LABEL_ID; every cell for Sudoku and Maze, the grid and its
  end-of-grid border for ARC, whose padding predictions do not split the votes); ties between
  answers broken by the best score among their trajectories, then the index.
- pass@K: solved when any trajectory's answer is exact (an oracle: it reads the labels).
- conv (EqR's convergence residual, Equilibrium Reasoners' evaluators/eval_fn.py): the trajectory
  whose logits changed least over the last `window` ACT steps: the mean over those steps and the
  positions of the L2 norm over the vocabulary of logits_t - logits_{t-1} (float32), tracked on
  the device while the D steps run (residual_step); ties: the lowest index. conv top-k: the
  fraction of exact answers among the k lowest residuals (ties: the lower index first).
K=1 without noise at the model's depth is not routed here at all: it is the reference's
evaluation, bit for bit.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from model import IGNORE_LABEL_ID, Carry
from modeling import counter_hash
from modeling.counter_hash import int32, mix

EXTRA_METRICS = ("mode_exact_accuracy", "pass_exact_accuracy", "conv_exact_accuracy", "conv_top_k_exact_accuracy")
"""What the evaluation step sums besides trainer.EVAL_METRICS with trajectories: the puzzles that
mode@K answers exactly, those that any of their K trajectories answers exactly (pass@K), those
that the lowest convergence residual answers exactly (conv), and the exact fraction of the
`top_k` lowest residuals' answers (conv top-k; conv itself at top_k 1)."""
CONVERGENCE_WINDOW = 3
"""EqR's convergence_window default (config/eval/depth_breadth.yaml)."""


def puzzle_keys(inputs: torch.Tensor, puzzle_identifiers: torch.Tensor) -> torch.Tensor:
    """[rows] int32: a hash of each row's input tokens (with their positions) and puzzle
    identifier; the same puzzle gets the same key in any batch, on any device."""
    positions = torch.arange(inputs.shape[1], device=inputs.device, dtype=torch.int32)
    tokens = mix(inputs.to(torch.int32) * int32(0x9E3779B1) + positions * int32(0x85EBCA77) + int32(0x165667B1))
    return mix(tokens.sum(-1, dtype=torch.int32) + puzzle_identifiers.to(torch.int32) * int32(0x27D4EB2F))


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """K noisy trajectories per puzzle: `perturb` is TRM.forward's hook, `select` picks each
    puzzle's answers. Rows: the module docstring's layout."""

    count: int
    """K, trajectories per puzzle."""
    noise: float
    """sigma: the standard deviation of the Gaussian noise added at every ACT step."""
    seed: int = 0
    """run.seed: the same seed, the same noise."""
    latent: str = "z_L"
    """Where the noise enters: z_L, z_H or both (testtime.NOISE_LATENTS)."""
    host_rows: int = 0
    """Rows of each host's part of a batch, each part laid out alone; 0: the whole batch is one."""
    halt_score: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    """The arch's halting rule (TRMConfig.halt_score: q_halt, or q_halt - q_continue for hrm and
    transformers_baseline) that ranks the trajectories; None: q_halt alone."""
    window: int = CONVERGENCE_WINDOW
    """The convergence residual's window: the last `window` logit changes of the D steps (EqR's
    convergence_window); all D - 1 of them when window is 0 or not below D - 1, as EqR does."""
    top_k: int = 1
    """k of conv top-k (EqR's convergence_top_k), at most K."""

    # -- the layout -----------------------------------------------------------------------------

    def _parts(self, rows: int) -> tuple[int, int, int]:
        """(parts, rows per part, puzzles per part) of a batch of `rows` rows."""
        part = self.host_rows or rows
        if rows % part or part < self.count:
            raise ValueError(f"a batch of {rows} rows in parts of {part} holds no puzzle of K={self.count} rows")
        return rows // part, part, part // self.count

    def groups(self, t: torch.Tensor) -> torch.Tensor:
        """[puzzles, K, ...]: the puzzle rows of t [rows, ...], padding rows left out."""
        parts, part, puzzles = self._parts(t.shape[0])
        rest = t.shape[1:]
        return t.reshape(parts, part, *rest)[:, :puzzles * self.count].reshape(parts * puzzles, self.count, *rest)

    def ungroup(self, g: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, ...]: g [puzzles, K, ...] back in its rows, zeros in the padding rows."""
        parts, part, puzzles = self._parts(rows)
        rest = g.shape[2:]
        g = g.reshape(parts, puzzles * self.count, *rest)
        pad = g.new_zeros((parts, part - puzzles * self.count, *rest))
        return torch.cat([g, pad], 1).reshape(rows, *rest)

    def trajectory_index(self, rows: int, device) -> torch.Tensor:
        """[rows] int32: each row's trajectory (padding rows: whatever follows)."""
        _, part, _ = self._parts(rows)
        return (torch.arange(rows, device=device, dtype=torch.int32) % part) % self.count

    def first_rows(self, rows: int, device) -> torch.Tensor:
        """Bool [rows]: the first row of each puzzle (False on padding rows)."""
        _, part, puzzles = self._parts(rows)
        offset = torch.arange(rows, device=device) % part
        return (offset % self.count == 0) & (offset < puzzles * self.count)

    def host_puzzle_rows(self, rows: int) -> slice:
        """The first row of each puzzle among one host's `rows` rows (a numpy slice)."""
        return slice(0, rows // self.count * self.count, self.count)

    # -- the noise ------------------------------------------------------------------------------

    def keys(self, data: dict[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """[rows] int32: the noise key of (seed, puzzle, trajectory, ACT step) of each row."""
        trajectory = self.trajectory_index(steps.shape[0], steps.device)
        key = mix(puzzle_keys(data["inputs"], data["puzzle_identifiers"]) + int32(self.seed * 0x9E3779B1))
        key = mix(key + trajectory * int32(0x85EBCA77))
        return mix(key + steps.to(torch.int32) * int32(0xC2B2AE3D))

    def perturb(self, z_H: torch.Tensor, z_L: torch.Tensor, data: dict[str, torch.Tensor],
                steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_H, z_L) with sigma * N(0, I) added to `latent`, drawn per (seed, puzzle, trajectory,
        ACT step `steps`); z_H's draw is independent of z_L's."""
        if self.noise == 0:
            return z_H, z_L
        keys = self.keys(data, steps)

        def noisy(z: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return (z.float() + self.noise * counter_hash.hashed_normal(k, tuple(z.shape[1:]))).to(z.dtype)

        if self.latent in ("z_H", "both"):
            z_H = noisy(z_H, mix(keys + int32(0x1B873593)))
        if self.latent in ("z_L", "both"):
            z_L = noisy(z_L, keys)
        return z_H, z_L

    # -- the selection --------------------------------------------------------------------------

    def scores(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[rows] float32: how much each trajectory wants to halt, by its arch's halting rule."""
        q_halt, q_continue = outputs["q_halt_logits"].float(), outputs.get("q_continue_logits")
        if self.halt_score is None:
            return q_halt
        return self.halt_score(q_halt, None if q_continue is None else q_continue.float())

    def best(self, scores: torch.Tensor) -> torch.Tensor:
        """Bool [puzzles, K]: each puzzle's best-Q trajectory, the first with the highest score."""
        return _first_of(self.groups(scores), lambda q: q == q.max(1, keepdim=True).values)

    def mode(self, predictions: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Bool [puzzles, K]: a trajectory of each puzzle's most frequent answer; ties between
        answers go to the one with the best score, then to the lowest index. An answer is the
        predicted tokens on the labelled cells (`valid`, bool like predictions: labels !=
        IGNORE_LABEL_ID): answers that differ only where no label is read (ARC's padding outside
        the grid) are one answer, as ARC's voter, which crops to the grid, counts them. Static
        shapes: the unlabelled cells are zeroed, not dropped."""
        answers = self.groups(torch.where(valid, predictions, torch.zeros_like(predictions))).flatten(2)
        same = (answers.unsqueeze(2) == answers.unsqueeze(1)).all(-1)  # [puzzles, K, K]
        votes = same.sum(-1)
        tied = votes == votes.max(1, keepdim=True).values
        q = torch.where(tied, self.groups(scores), torch.finfo(torch.float32).min)
        return _first_of(q, lambda v: tied & (v == v.max(1, keepdim=True).values))

    def deltas_kept(self, act_steps: int) -> int:
        """How many of the D - 1 logit changes of D ACT steps the residual averages (EqR's rule:
        the last `window` when 0 < window < D - 1, else all D - 1)."""
        return self.window if 0 < self.window < act_steps - 1 else max(act_steps - 1, 0)

    def residual_step(self, previous: torch.Tensor, total: torch.Tensor, logits: torch.Tensor,
                      steps: torch.Tensor, act_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits as float32, the new running sum [rows]) after an ACT step: `previous` holds the
        last step's logits [rows, T, V] (float32), `total` each row's sum so far of the mean over
        positions of ||logits_t - logits_{t-1}||_2 over the steps t the window keeps; `steps` the
        rows' steps after this one (1: a new puzzle, whose sum starts over). Static shapes, no
        branch on device values."""
        logits = logits.float()
        change = torch.linalg.vector_norm(logits - previous, dim=-1).mean(-1)
        kept = (steps >= 2) & (steps > act_steps - self.deltas_kept(act_steps))
        total = torch.where(steps == 1, torch.zeros_like(total), total) + torch.where(kept, change,
                                                                                       torch.zeros_like(change))
        return logits, total

    def residual(self, total: torch.Tensor, act_steps: int) -> torch.Tensor:
        """[rows]: each row's convergence residual (EqR's score) from residual_step's sum at step D."""
        return total / max(self.deltas_kept(act_steps), 1)

    def convergence_ranks(self, residual: torch.Tensor) -> torch.Tensor:
        """Int [puzzles, K]: each trajectory's place among its puzzle's when sorted by residual,
        lowest first, ties by the lower index (0: conv's pick)."""
        r = self.groups(residual.float())
        index = torch.arange(self.count, device=r.device)
        before = (r.unsqueeze(1) < r.unsqueeze(2)) | ((r.unsqueeze(1) == r.unsqueeze(2))
                                                      & (index.view(1, 1, -1) < index.view(1, -1, 1)))
        return before.sum(-1)

    def select(self, carry: Carry, outputs: dict[str, torch.Tensor], residual: torch.Tensor | None = None
               ) -> tuple[Carry, dict[str, torch.Tensor], list[torch.Tensor]]:
        """(carry, outputs, [mode@K exact, pass@K exact, conv exact, conv top-k exact] sums): every
        puzzle row holds its best-Q trajectory's logits and Q logits, and only the puzzle's first
        row is halted (counted by loss_and_metrics): the metrics are those of the best-Q answers,
        one per puzzle; the extra sums count the counted puzzles (halted, with labels) that mode@K,
        pass@K and conv solve, and conv top-k's fraction of exact answers among its k picks.
        `residual` [rows]: the convergence residuals (residual()); None: all equal (conv picks
        trajectory 0)."""
        rows = carry.halted.shape[0]
        scores = self.scores(outputs)
        predictions = outputs["logits"].argmax(-1)
        chosen = self.best(scores)

        def spread(t: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:  # the picked row on its K rows
            g = self.groups(t)
            mask = pick.view(*pick.shape, *([1] * (g.ndim - 2)))
            picked = torch.where(mask, g, torch.zeros((), dtype=t.dtype, device=t.device)).sum(1, keepdim=True,
                                                                                               dtype=t.dtype)
            return self.ungroup(picked.expand(g.shape), rows)

        labels = carry.current_data["labels"]
        valid = labels != IGNORE_LABEL_ID
        solved = self.groups((valid & (predictions == labels)).sum(-1) == valid.sum(-1))
        counted = self.groups(carry.halted & (valid.sum(-1) > 0))[:, 0]
        by_mode = (solved & self.mode(predictions, scores, valid)).any(1)
        extra = [(counted & by_mode).sum().float(), (counted & solved.any(1)).sum().float()]
        if residual is None:
            residual = torch.zeros(rows, device=predictions.device)
        ranks, k = self.convergence_ranks(residual), min(self.top_k, self.count)
        by_conv = (solved & (ranks == 0)).any(1)
        top_k = (solved & (ranks < k)).sum(1).float() / k
        extra += [(counted & by_conv).sum().float(), torch.where(counted, top_k, torch.zeros_like(top_k)).sum()]
        selected = {name: spread(outputs[name], chosen) for name in ("logits", "q_halt_logits", "q_continue_logits")
                    if name in outputs}
        first = self.first_rows(rows, carry.halted.device)
        return dataclasses.replace(carry, halted=carry.halted & first), selected, extra


def _first_of(values: torch.Tensor, where) -> torch.Tensor:
    """Bool like values [puzzles, K]: the first trajectory of each puzzle where `where(values)`."""
    k = values.shape[1]
    index = torch.arange(k, device=values.device)
    first = torch.where(where(values), index, k).min(1, keepdim=True).values
    return index == first


def trajectories_of(k: int, noise: float, seed: int, latent: str = "z_L", host_rows: int = 0,
                    halt_score=None, window: int = CONVERGENCE_WINDOW, top_k: int = 1) -> Trajectories | None:
    """What Trainer.set_evaluation takes for K and sigma: None (the reference's evaluation,
    untouched) for one trajectory without noise."""
    return None if k == 1 and noise == 0 else Trajectories(k, noise, seed, latent, host_rows, halt_score,
                                                           window, top_k)


def set_evaluation(trainer, setting, global_batch_size: int | None = None) -> Trajectories | None:
    """Set the trainer's evaluation to a test-time setting (testtime.Setting): its trajectories
    (None at K=1 without noise), laid out in each host's share of a batch of global_batch_size
    rows (optim.global_batch_size unless given) and ranked by the model's halting rule, at its
    depth D. Returns the trajectories."""
    config = trainer.config
    rows = (global_batch_size or config.optim.global_batch_size) // trainer.sharding.data_split()[1]
    evaluation = getattr(config, "eval", None)  # --eval.convergence-window / -top-k (EqR's defaults without)
    trajectories = trajectories_of(setting.k, setting.noise, config.run.seed, setting.latent, rows,
                                   halt_score=config.model.halt_score,
                                   window=getattr(evaluation, "convergence_window", CONVERGENCE_WINDOW),
                                   top_k=getattr(evaluation, "convergence_top_k", 1))
    trainer.set_evaluation(trajectories, setting.act_steps)
    return trajectories
