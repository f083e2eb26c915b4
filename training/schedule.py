"""The run's schedules, pure functions of the configuration, the dataset's size and the step:
how many steps the run trains, the steps after which it evaluates, the learning rate of each
step, the recursion curriculum's cycles of each step, and the halting anneal's span."""
from __future__ import annotations

import dataclasses
import math

from data import total_train_steps
from training.config import ConfigError, OptimConfig


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


class Curriculum:
    """The recursion curriculum (the seeds' contrib01_curriculum; optim.curriculum_epochs, off at
    0): the (H_cycles, L_cycles) that training step `step` (counted from 1) recurses with. Each
    grows linearly from optim.curriculum_start_*_cycles to the model's over the first
    curriculum_epochs epochs, floored as the seeds' int(start + progress * (end - start)) is, with
    progress = the epochs trained before the step / curriculum_epochs (capped at 1) in exact
    integers: a pure function of the step, so a resumed run lands in its stage. Each stage is a
    program of its own (trainer.Trainer.step). Evaluation always recurses with the model's cycles.
    `full_steps`: the steps that train optim.epochs (data.total_train_steps)."""

    def __init__(self, config, full_steps: int):
        self.optim, self.model, self.full_steps = config.optim, config.model, max(1, full_steps)

    def at(self, step: int) -> tuple[int, int]:
        optim, model = self.optim, self.model
        done, span = (step - 1) * optim.epochs, self.full_steps * optim.curriculum_epochs
        if not optim.curriculum_epochs or done >= span:
            return model.H_cycles, model.L_cycles
        return (optim.curriculum_start_H_cycles + (model.H_cycles - optim.curriculum_start_H_cycles) * done // span,
                optim.curriculum_start_L_cycles + (model.L_cycles - optim.curriculum_start_L_cycles) * done // span)

    def stages(self, last_step: int) -> list[tuple[int, tuple[int, int]]]:
        """(first step, (H_cycles, L_cycles)) of each stage the steps 1..last_step train in."""
        optim, span = self.optim, self.full_steps * self.optim.curriculum_epochs
        starts = {1}
        for start, end in ((optim.curriculum_start_H_cycles, self.model.H_cycles),
                           (optim.curriculum_start_L_cycles, self.model.L_cycles)):
            for k in range(1, end - start + 1) if optim.curriculum_epochs else ():
                # the first step whose (step - 1) * epochs * (end - start) >= k * span
                starts.add(1 + -(-k * span // ((end - start) * optim.epochs)))
        out = []
        for step in sorted(s for s in starts if s <= last_step):
            if not out or out[-1][1] != self.at(step):
                out.append((step, self.at(step)))
        return out

    def stage_steps(self, first: int, last: int) -> list[tuple[tuple[int, int], int]]:
        """((H_cycles, L_cycles), how many of the steps first..last train in it) of each stage
        those steps train in, in order (none for an empty range): what the steps' compute is
        counted from (a stage's model FLOPs are those of its cycles, model_flops.stage_flops)."""
        if last < first:
            return []
        stages = self.stages(last)
        out = []
        for i, (start, cycles) in enumerate(stages):
            end = stages[i + 1][0] - 1 if i + 1 < len(stages) else last
            steps = min(end, last) - max(start, first) + 1
            if steps > 0:
                out.append((cycles, steps))
        return out


def resolve_anneal(config, full_steps: int):
    """`config` (config.Config) with model.halt_exploration_anneal_steps 0 (the whole run) made
    `full_steps`, the steps of optim.epochs (not of a shorter optim.max_steps: the span stays the
    same when a resumed run changes it); unchanged without an anneal (modeling/schemes.py)."""
    model = config.model
    if model.halt_exploration_final is None or model.halt_exploration_anneal_steps:
        return config
    annealed = dataclasses.replace(model, halt_exploration_anneal_steps=max(1, full_steps))
    return dataclasses.replace(config, model=annealed)
