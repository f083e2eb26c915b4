"""The attention's core, softmax(q k^T / sqrt(d)) v over q, k, v [batch, heads, seq, head_dim],
in the two forms a run can choose (model.TRMConfig.attention):

    sdpa       torch's F.scaled_dot_product_attention, the reference's call. On its GPUs that is
               a fused kernel; on XLA it is torch's math path: q, k and v upcast to float32 and
               the float32 scores and probabilities of every head and pair of positions written
               to HBM ([batch, heads, seq, seq], kept for the backward).
    blockwise  keys that fit in one block (`block`): the math written out, without the SDPA
               math path's float32 copies of q, k, v and its masked `_safe_softmax`; autograd's
               backward keeps the [batch, heads, seq, seq] probabilities, as sdpa does. Longer
               sequences: the same math over blocks of keys with an online softmax (Rabe and
               Staats 2021), and a backward that recomputes each block's probabilities from q, k and the
               saved log-sum-exp (FlashAttention-2's algorithm, Dao 2023), in plain PyTorch that
               any XLA backend compiles. Nothing of shape [batch, heads, seq, seq] exists; each
               block's [batch, heads, seq, block] scores live only while that block is worked on.
               As in the fused GPU kernels the reference runs on: the matmuls take the
               inputs' dtype (bf16 in the presets) and sum in float32, the scores and the
               softmax are float32, and the probabilities meet v in v's dtype.

Plain PyTorch (model.py imports it; it never imports torch_xla): on XLA the backward needs an
optimization barrier (`use_barrier`, set by training/capture.py) so that XLA does not merge the recomputed
scores with the forward's and keep them alive after all.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

ATTENTIONS = ("blockwise", "sdpa")

_barrier: Callable[[list[torch.Tensor]], None] | None = None


def use_barrier(barrier: Callable[[list[torch.Tensor]], None]) -> None:
    """Set the optimization barrier applied to what the blockwise backward reads on XLA tensors
    (torch_xla's xm.optimization_barrier_: its outputs are values XLA cannot equate with others)."""
    global _barrier
    _barrier = barrier


def key_blocks(length: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scores, the softmax and the sums are kept in: float32, or the inputs' if wider."""
    return torch.promote_types(dtype, torch.float32)


def _matmul_wide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of a's and b's own values, not rounded back to their dtype (on a TPU, XLA's default
    precision: one bf16 pass summed in float32)."""
    return torch.matmul(a.to(_wide(a.dtype)), b.to(_wide(b.dtype)))


def _forward(q, k, v, block: int):
    """Online softmax over key blocks: the output and the rows' log-sum-exp (float32 or wider)."""
    scale = q.shape[-1] ** -0.5
    rows, wide = q.shape[:-1], _wide(q.dtype)
    running_max = torch.full(rows, -math.inf, dtype=wide, device=q.device)
    running_sum = torch.zeros(rows, dtype=wide, device=q.device)
    acc = torch.zeros(q.shape, dtype=wide, device=q.device)

    # v with a column of ones: probabilities @ [v, 1] gives their weighted sum of v and their own
    # row sum in one matmul (on a TPU the extra column rides in the matrix unit's padding; a
    # separate sum over the keys reads the float32 probabilities again: docs/measurements.md). The
    # sum is then of the probabilities as they meet v (bf16 in the presets, summed in float32):
    # the weights of the average sum to 1.
    v_ones = torch.cat([v, torch.ones(v.shape[:-1] + (1,), dtype=v.dtype, device=v.device)], dim=-1)
    for start, end in key_blocks(k.shape[-2], block):
        scores = _matmul_wide(q, k[..., start:end, :].transpose(-2, -1)) * scale
        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        probs = torch.exp(scores - new_max.unsqueeze(-1))
        rescale = torch.exp(running_max - new_max)  # 0 for the first block (its max is -inf)
        weighted = _matmul_wide(probs.to(v.dtype), v_ones[..., start:end, :])
        running_sum = running_sum * rescale + weighted[..., -1]
        acc = acc * rescale.unsqueeze(-1) + weighted[..., :-1]
        running_max = new_max
    return (acc / running_sum.unsqueeze(-1)).to(q.dtype), running_max + torch.log(running_sum)


def _direct(q, k, v):
    """The same numerics over all keys at once: float32 scores and softmax, the probabilities
    meeting v in v's dtype (without torch's SDPA math path's float32 copies of q, k, v and its
    masked `_safe_softmax`)."""
    scores = _matmul_wide(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block):
        out, log_sum_exp = _forward(q, k, v, block)
        ctx.save_for_backward(q, k, v, out, log_sum_exp)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, log_sum_exp = ctx.saved_tensors
        if _barrier is not None and q.device.type == "xla":
            q, k, v, out, log_sum_exp, grad_out = (t.clone() for t in (q, k, v, out, log_sum_exp, grad_out))
            _barrier([q, k, v, out, log_sum_exp, grad_out])
        scale = q.shape[-1] ** -0.5
        # dS = P * (dP - rowsum(dO * O)): softmax's backward with the row term from the output.
        wide = _wide(q.dtype)
        row_term = (grad_out.to(wide) * out.to(wide)).sum(dim=-1, keepdim=True)
        grad_q = torch.zeros(q.shape, dtype=wide, device=q.device)
        grad_k, grad_v = [], []
        for start, end in key_blocks(k.shape[-2], ctx.block):
            k_block, v_block = k[..., start:end, :], v[..., start:end, :]
            scores = _matmul_wide(q, k_block.transpose(-2, -1)) * scale
            probs = torch.exp(scores - log_sum_exp.unsqueeze(-1))
            # dV = P^T dO and dK = dS^T Q written as (dO^T P)^T and (Q^T dS)^T: the same sums over
            # the queries, with the [.., seq, block] matrix as the matmul's right operand as it is laid
            # out (XLA wrote a transposed copy of each otherwise: docs/measurements.md).
            grad_v.append(torch.matmul(grad_out.transpose(-2, -1), probs.to(grad_out.dtype)).transpose(-2, -1))
            grad_probs = _matmul_wide(grad_out, v_block.transpose(-2, -1))
            grad_scores = (probs * (grad_probs - row_term) * scale).to(q.dtype)
            grad_q = grad_q + _matmul_wide(grad_scores, k_block)
            grad_k.append(torch.matmul(q.transpose(-2, -1), grad_scores).transpose(-2, -1))
        return (grad_q.to(q.dtype), torch.cat(grad_k, dim=-2).to(k.dtype), torch.cat(grad_v, dim=-2).to(v.dtype),
                None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v, bidirectional, no mask; `kind` one of ATTENTIONS,
    `block` the blockwise form's keys per block."""
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)
    if kind == "blockwise":
        if k.shape[-2] <= block:  # one block: the written-out math, autograd's backward (nothing to recompute)
            return _direct(q, k, v)
        return _BlockwiseAttention.apply(q, k, v, block)
    raise ValueError(f"attention {kind!r} is not one of {ATTENTIONS}")


def blockwise_extra_flops(length: int, width: int, heads: int) -> tuple[int, int]:
    """FLOPs per example that the blockwise form over blocks of keys computes beyond the
    attention's own matmuls, per attention application: in the forward, the probabilities' row
    sums (the column of ones beside v, 2·length²·heads); in the backward, the scores q k^T again
    (2·length²·width)."""
    return 2 * length * length * heads, 2 * length * length * width
