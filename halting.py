"""ACT halting beyond the reference's rule: when the Q head first says halt in an evaluation (the
halting-step distribution, one of the seed study's metrics), and the training's halting
exploration probability annealed over the run (the seeds' contrib02_adaptive).

The distribution. An evaluation runs every ACT step (as the reference's does), so halting never
shortens it; what the Q head *would* do is counted instead. A row says halt at an ACT step when
q_halt > 0 (sigmoid(q_halt) > 0.5) with no_ACT_continue, else when q_halt > q_continue: the
rule training halts by. `first_halt` tracks, for each row, the first ACT step it said so (0:
not yet); at the batch's last ACT step, where the row is counted (halted, with labels), its
step lands in one of halt_max_steps + 1 buckets: steps 1..halt_max_steps, and `never_halted`
for a row whose Q head never said halt (a separate bucket; `mean_halt_step` counts it at
halt_max_steps, where an ACT model stops it). Everything is a device tensor added to the
evaluation's sums: no host read in the loop, one read with the other metrics at the end.
With K trajectories (ptrm.py) it is the chosen trajectory's q_halt > 0 at each step.

The anneal. `exploration_prob(config, counter)`: the probability that a training row gets a
random minimum number of ACT steps at training step counter + 1 (the carry's rng_counter counts
the steps before), linear from halt_exploration_prob to halt_exploration_final over
halt_exploration_anneal_steps steps, then flat; a device value, so the step's program is the
same at every step and a resumed run (whose carry restores the counter) continues exactly.
"""
from __future__ import annotations

import numpy as np
import torch

from data import IGNORE_LABEL_ID


def metric_names(halt_max_steps: int) -> tuple[str, ...]:
    """The evaluation sums' halting buckets: halted_at_1 .. halted_at_{halt_max_steps}, never_halted."""
    return tuple(f"halted_at_{s}" for s in range(1, halt_max_steps + 1)) + ("never_halted",)


def says_halt(q_halt: torch.Tensor, q_continue: torch.Tensor | None, no_ACT_continue: bool) -> torch.Tensor:
    """bool [B]: where the Q head says halt, the one rule of training's halting and of the
    evaluation's distribution: q_halt > 0 (sigmoid > 0.5), or q_halt > q_continue when the config
    learns a Q-continue (no_ACT_continue False: hrm, transformers_baseline); q_halt > 0 without
    q_continue logits."""
    return q_halt > 0 if no_ACT_continue or q_continue is None else q_halt > q_continue


def first_halt_counts(first_halt: torch.Tensor, carry, outputs: dict[str, torch.Tensor], halt_max_steps: int,
                      no_ACT_continue: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new first_halt [B] int32, float32 [halt_max_steps + 1] counts of the rows counted at
    this ACT step by their first halting step, metric_names' order). `carry` is the step's new
    carry: a row at its step 1 starts over; a counted row is halted and has labels."""
    steps = carry.steps
    first_halt = torch.where(steps == 1, 0, first_halt)
    halts = says_halt(outputs["q_halt_logits"], outputs.get("q_continue_logits"), no_ACT_continue)
    first_halt = torch.where((first_halt == 0) & halts, steps, first_halt)
    counted = carry.halted & (carry.current_data["labels"] != IGNORE_LABEL_ID).any(-1)
    bucket = torch.where(first_halt == 0, halt_max_steps, first_halt - 1)
    buckets = torch.arange(halt_max_steps + 1, device=steps.device)
    counts = ((bucket.unsqueeze(-1) == buckets) & counted.unsqueeze(-1)).sum(0)
    return first_halt.to(torch.int32), counts.float()


def summarize(result: dict[str, float], halt_max_steps: int) -> dict[str, float]:
    """`result` (fractions of the counted puzzles per bucket) with mean_halt_step added: the mean
    first halting step, never-halted puzzles at halt_max_steps; absent with nothing counted."""
    fractions = [result[name] for name in metric_names(halt_max_steps)]
    if sum(fractions) > 0:
        steps = list(range(1, halt_max_steps + 1)) + [halt_max_steps]
        result["mean_halt_step"] = float(sum(s * f for s, f in zip(steps, fractions)))
    return result


def is_bucket(name: str) -> bool:
    """A halting bucket's metric name (shown as one histogram rather than one scalar each)."""
    return name.startswith("halted_at_") or name == "never_halted"


def histogram(result: dict[str, float]) -> dict | None:
    """TensorBoard's add_histogram_raw arguments for an evaluation's halting buckets: one bucket
    per ACT step, never-halted puzzles at the last step (as mean_halt_step counts them), counts
    of puzzles; None without buckets or counted puzzles."""
    steps = sorted(int(k.removeprefix("halted_at_")) for k in result if k.startswith("halted_at_"))
    if not steps or "mean_halt_step" not in result:
        return None
    counts = np.array([result[f"halted_at_{s}"] for s in steps]) * result["count"]
    counts[-1] += result["never_halted"] * result["count"]
    values = np.array(steps, dtype=np.float64)
    return dict(min=float(values[counts > 0].min()), max=float(values[counts > 0].max()), num=float(counts.sum()),
                sum=float((values * counts).sum()), sum_squares=float((values ** 2 * counts).sum()),
                bucket_limits=[s + 0.5 for s in steps], bucket_counts=counts.tolist())


def exploration_prob(config, counter: torch.Tensor):
    """The halting exploration probability of the training step after `counter` steps (a device
    value), or config.halt_exploration_prob (a float) when there is no anneal."""
    start, final = config.halt_exploration_prob, config.halt_exploration_final
    if final is None:
        return start
    progress = ((counter + 1).float() / config.halt_exploration_anneal_steps).clamp(max=1.0)
    return start + (final - start) * progress

