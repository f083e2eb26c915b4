"""The run's schedules, pure functions of the configuration, the dataset's size and the step:
how many steps the run trains, the steps after which it evaluates, and the learning rate of
each step."""
from __future__ import annotations

import math

from batches import total_train_steps
from config import ConfigError, OptimConfig


def lr_at(step: int, peak: float, optim: OptimConfig, total_steps: int) -> float:
    """The learning rate of update `step` (counted from 1: the reference increments its counter
    before the update):

      1. warmup: linear from 0 to `peak` over optim.lr_warmup_steps;
      2. then, by optim.lr_schedule, over the rest of the run's total_steps:
         cosine   (the reference's) half a cosine from peak down to lr_min_ratio·peak,
         linear   a straight line from peak down to lr_min_ratio·peak,
         constant peak.
    With lr_min_ratio 1.0 (every paper recipe) all three are constant after warmup.
    """
    if step < optim.lr_warmup_steps:
        return peak * step / max(1, optim.lr_warmup_steps)
    progress = min(1.0, (step - optim.lr_warmup_steps) / max(1, total_steps - optim.lr_warmup_steps))
    floor = optim.lr_min_ratio
    if optim.lr_schedule == "constant":
        return peak
    if optim.lr_schedule == "linear":
        return peak * (floor + (1 - floor) * (1 - progress))
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


def run_schedule(metadata, optim: OptimConfig, eval_every_epochs: int) -> tuple[int, list[int]]:
    """(the run's last step, the steps after which it evaluates) for a train split's `metadata`
    (data.Metadata): optim.epochs of it in global batches, or optim.max_steps if fewer. A
    recipe whose epochs make no step raises ConfigError naming the fix (max_steps 0 is allowed:
    it only evaluates)."""
    full_steps = total_train_steps(metadata, optim.epochs, optim.global_batch_size)
    if full_steps < 1 and optim.max_steps != 0:
        examples = round(metadata.total_groups * metadata.mean_puzzle_examples)
        raise ConfigError(f"optim.epochs={optim.epochs} of this dataset's {examples} examples per epoch "
                          f"make no step of optim.global_batch_size={optim.global_batch_size}: raise "
                          f"--optim.epochs to at least {-(-optim.global_batch_size // max(examples, 1))} or lower "
                          "--optim.global-batch-size")
    total_steps = full_steps if optim.max_steps is None else min(full_steps, optim.max_steps)
    return total_steps, evaluation_steps(full_steps, optim.epochs, eval_every_epochs, total_steps)
