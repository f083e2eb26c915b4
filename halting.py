"""When an ACT row halts, by the Q head: the one rule that training halts by, the score that ranks
test-time trajectories by it (ptrm.py), and the training's halting exploration probability
annealed over the run (the seeds' contrib02_adaptive). The evaluation's halting-step distribution
is halt_steps.py's.

The rule. A row says halt when q_halt > 0 (sigmoid(q_halt) > 0.5) with no_ACT_continue, else when
q_halt > q_continue (hrm, transformers_baseline): `says_halt`. `halt_score` is the quantity the
rule compares with 0 (q_halt, or q_halt - q_continue): the higher, the more the row wants to halt.

The anneal. `exploration_prob(config, counter)`: the probability that a training row gets a
random minimum number of ACT steps at training step counter + 1 (the carry's rng_counter counts
the steps before), linear from halt_exploration_prob to halt_exploration_final over
halt_exploration_anneal_steps steps, then flat; a device value, so the step's program is the
same at every step and a resumed run (whose carry restores the counter) continues exactly.
"""
from __future__ import annotations

import torch


def says_halt(q_halt: torch.Tensor, q_continue: torch.Tensor | None, no_ACT_continue: bool) -> torch.Tensor:
    """bool [B]: where the Q head says halt, the one rule of training's halting and of the
    evaluation's distribution: q_halt > 0 (sigmoid > 0.5), or q_halt > q_continue when the config
    learns a Q-continue (no_ACT_continue False: hrm, transformers_baseline); q_halt > 0 without
    q_continue logits."""
    return q_halt > 0 if no_ACT_continue or q_continue is None else q_halt > q_continue


def halt_score(q_halt: torch.Tensor, q_continue: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B]: how much a row wants to halt by says_halt's rule: q_halt, or q_halt - q_continue
    when the arch halts on q_halt > q_continue (pass q_continue only then)."""
    return q_halt.float() if q_continue is None else q_halt.float() - q_continue.float()


def exploration_prob(config, counter: torch.Tensor):
    """The halting exploration probability of the training step after `counter` steps (a device
    value), or config.halt_exploration_prob (a float) when there is no anneal."""
    start, final = config.halt_exploration_prob, config.halt_exploration_final
    if final is None:
        return start
    progress = ((counter + 1).float() / config.halt_exploration_anneal_steps).clamp(max=1.0)
    return start + (final - start) * progress
