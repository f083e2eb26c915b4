"""The model's FLOPs per example, counted from its shapes: a training step's (forward and
backward) and an evaluation ACT step's, at the model's cycles or a recursion curriculum stage's.
The step line's TFLOP/s and MFU read them (training/run_log.py), and so does the TPU cost model's
device time at a given MFU (tpu_costs/run_costs.py)."""
from __future__ import annotations

import dataclasses

from model import TRMConfig, swiglu_width
from modeling.attention import blockwise_extra_flops


def block_flops(c: TRMConfig) -> int:
    """Forward FLOPs of one block for one example (2·m·n·k per matmul, nothing else counted).

    With T = seq_len + prefix positions, h = hidden_size, I = swiglu_width(h), I_T = swiglu_width(T),
    a = num_heads · (h // num_heads) the heads' total width (h, unless the heads do not divide h):
      SwiGLU over channels:      gate_up 2·T·h·2I + down 2·T·I·h              = 6·T·h·I
      attention (not mlp_t):     qkv 2·T·h·3a + scores 2·T·T·a + values 2·T·T·a + out 2·T·a·h
                                                                              = 8·T·h·a + 4·T²·a
      token-mixing SwiGLU (mlp_t, over positions for each of the h channels) = 6·h·T·I_T
    """
    T, h = c.total_len, c.hidden_size
    channel_mlp = 6 * T * h * swiglu_width(h, c.expansion)
    if c.mlp_t:
        mixing = 6 * h * T * swiglu_width(T, c.expansion)
    else:
        a = c.num_heads * (h // c.num_heads)
        mixing = 8 * T * h * a + 4 * T * T * a
    return mixing + channel_mlp


def heads_flops(c: TRMConfig) -> int:
    """Forward FLOPs of the output heads for one example: lm_head over all T positions
    (the prefix is dropped after the matmul) 2·T·h·vocab, and q_head on position 0, 2·h·2."""
    return 2 * c.total_len * c.hidden_size * c.vocab_size + 2 * c.hidden_size * 2


def recursion_counts(c: TRMConfig) -> tuple[int, int, int]:
    """(block applications of one ACT step, those of them that run backward, forward passes of
    the recursion per example in a training step): the arch's updates (modeling/schemes.py), each a
    network of some blocks. The first is the TRM paper's "effective depth per supervision step"
    (Table 1: T(n + 1)·n_layers; trm's H_cycles·(L_cycles + 1)·L_layers, 42 for sudoku-mlp, 24 for
    HRM's 2·3·4), the last its "number of forward passes (NFP) per optimization step": 2 where
    the Q-continue target needs a second pass of the recursion (HRM, "w/ ACT"), else 1."""
    scheme = c.scheme
    layers = scheme.networks(c)
    per_update = [layers[scheme.network_of(kind, c)] for kind in scheme.schedule(c)]
    target = scheme.q_continue_target(c)
    return sum(per_update), sum(per_update[-scheme.grad_updates(c):]), 2 if target else 1


def model_flops(c: TRMConfig) -> dict[str, int]:
    """Model FLOPs per example of one training step and of one evaluation ACT step.

    One ACT step applies the arch's updates (modeling/schemes.py's schedule; trm: H_cycles · (L_cycles + 1),
    each cycle L_cycles updates of z_L and one of z_H), each a network of some blocks (trm: the one
    shared network of L_layers), then the heads once: A block applications. Only the last G
    updates (trm: the last cycle, L_cycles + 1; hrm and one_step_grad: 2) and the heads run
    backward, which costs twice their forward (gradients of inputs and of weights); with G_b their
    blocks:

      eval  = A · block + heads
      train = A · block + heads + 2 · (G_b · block + heads)
              (+ A · block + heads without gradient when the Q-continue target is computed)

    Embedding lookups, norms, RoPE, activations, the loss and the optimizers are not counted
    (elementwise; SignSGD's [B, B] id-matching matmul adds 2·B·puzzle_emb_ndim per example,
    under 0.01% here). For sudoku-mlp: 21 forward applications, 7 of them with backward,
    about 43 GFLOP per example.

    "train_extra", "eval_extra" (not in MFU): the blockwise attention's own work over blocks of
    keys (T > attention_block): row sums in the forward, the scores again in the backward."""
    block, heads = block_flops(c), heads_flops(c)
    applications, with_grad, passes = recursion_counts(c)
    forward = applications * block + heads
    train_flops = forward + 2 * (with_grad * block + heads)
    target = passes == 2
    if target:
        train_flops += forward
    blocks = not c.mlp_t and c.attention == "blockwise" and c.total_len > c.attention_block
    width = c.num_heads * (c.hidden_size // c.num_heads)
    row_sums, scores_again = blockwise_extra_flops(c.total_len, width, c.num_heads) if blocks else (0, 0)
    eval_extra = applications * row_sums
    train_extra = eval_extra * (2 if target else 1) + with_grad * scores_again
    return {"train": train_flops, "eval": forward, "train_extra": train_extra, "eval_extra": eval_extra}


def stage_flops(c: TRMConfig, cycles: tuple[int, int]) -> dict[str, int]:
    """`model_flops` of the model recursing with (H_cycles, L_cycles) = `cycles`: a stage of the
    recursion curriculum (schedule.Curriculum), whose steps recurse with fewer cycles than the
    model's (the first stage of contrib01's Sudoku curriculum, (1, 2), costs 1/7 of (3, 6)'s)."""
    return model_flops(dataclasses.replace(c, H_cycles=cycles[0], L_cycles=cycles[1]))


