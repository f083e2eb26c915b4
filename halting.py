"""The training's halting exploration probability annealed over the run (the seeds'
contrib02_adaptive). The evaluation's halting-step distribution is halt_steps.py's.

The rule is each arch's own (recursion.RecursionScheme.halt_score, read through
TRMConfig.halt_score): a row says halt where its score is > 0 (q_halt alone with no_ACT_continue,
sigmoid(q_halt) > 0.5; else q_halt - q_continue, the rule of hrm and transformers_baseline), and
the higher the score, the more the row wants to halt. Training halts by it (model.py), the
evaluation's histogram reads it (halt_steps.py), and test-time selection ranks by it (ptrm.py).

The anneal. `exploration_prob(config, counter)`: the probability that a training row gets a
random minimum number of ACT steps at training step counter + 1 (the carry's rng_counter counts
the steps before), linear from halt_exploration_prob to halt_exploration_final over
halt_exploration_anneal_steps steps, then flat; a device value, so the step's program is the
same at every step and a resumed run (whose carry restores the counter) continues exactly.
"""
from __future__ import annotations

import torch


def exploration_prob(config, counter: torch.Tensor):
    """The halting exploration probability of the training step after `counter` steps (a device
    value), or config.halt_exploration_prob (a float) when there is no anneal."""
    start, final = config.halt_exploration_prob, config.halt_exploration_final
    if final is None:
        return start
    progress = ((counter + 1).float() / config.halt_exploration_anneal_steps).clamp(max=1.0)
    return start + (final - start) * progress
