"""The halting-step distribution of an evaluation (one of the seed study's metrics): when the Q
head first says halt.

An evaluation runs all its D ACT steps (eval.act_steps, the model's halt_max_steps unless told:
as the reference's does), so halting never shortens it; what the Q head *would* do is counted
instead, by the rule training halts by (the arch's halt_score > 0: q_halt > 0 with no_ACT_continue, else
q_halt > q_continue). `first_halt` tracks, for each row, the first ACT step it said so (0: not
yet); at the batch's last ACT step, where the row is counted (halted, with labels), its step
lands in one of D + 1 buckets: steps 1..D, and `never_halted` for a row whose Q head never said
halt (a separate bucket; `mean_halt_step` counts it at D, where the evaluation stops it).
Everything is a device tensor added to the evaluation's sums: no host read in the loop, one read
with the other metrics at the end. With K trajectories (testtime/noisy_trajectories.py) it is the rule read on each
step's best-Q trajectory (its q_halt and q_continue).
"""
from __future__ import annotations

import numpy as np
import torch

from data import IGNORE_LABEL_ID


def metric_names(steps: int) -> tuple[str, ...]:
    """The evaluation sums' halting buckets: halted_at_1 .. halted_at_{steps}, never_halted."""
    return tuple(f"halted_at_{s}" for s in range(1, steps + 1)) + ("never_halted",)


def first_halt_counts(first_halt: torch.Tensor, carry, outputs: dict[str, torch.Tensor], steps_max: int,
                      halt_score) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new first_halt [B] int32, float32 [steps_max + 1] counts of the rows counted at this
    ACT step by their first halting step, metric_names' order). `carry` is the step's new carry:
    a row at its step 1 starts over; a counted row is halted and has labels."""
    steps = carry.steps
    first_halt = torch.where(steps == 1, 0, first_halt)
    halts = halt_score(outputs["q_halt_logits"], outputs.get("q_continue_logits")) > 0
    first_halt = torch.where((first_halt == 0) & halts, steps, first_halt)
    counted = carry.halted & (carry.current_data["labels"] != IGNORE_LABEL_ID).any(-1)
    bucket = torch.where(first_halt == 0, steps_max, first_halt - 1)
    buckets = torch.arange(steps_max + 1, device=steps.device)
    counts = ((bucket.unsqueeze(-1) == buckets) & counted.unsqueeze(-1)).sum(0)
    return first_halt.to(torch.int32), counts.float()


def with_mean_halt_step(result: dict[str, float], steps_max: int) -> dict[str, float]:
    """`result` (fractions of the counted puzzles per bucket) with mean_halt_step added: the mean
    first halting step, never-halted puzzles at steps_max; absent with nothing counted."""
    fractions = [result[name] for name in metric_names(steps_max)]
    if sum(fractions) > 0:
        steps = list(range(1, steps_max + 1)) + [steps_max]
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
