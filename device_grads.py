"""Dense weight gradients reduced as the reference reduces them: each device sums a weight's uses
in float32, then the devices sum once, in float32.

The reference (PyTorch DDP on G GPUs) keeps float32 weights and casts them to bfloat16 at every
use (`CastedLinear`). Each use's weight gradient is the bfloat16 matmul of that GPU's rows,
rounded to bfloat16 once; the cast's backward turns it into float32 and autograd adds the uses in
float32; DDP then all-reduces the float32 sum across GPUs, once per weight.

Left to itself, XLA's SPMD partitioner computes each use's bfloat16 weight-gradient matmul as a
partial sum over the device's rows and all-reduces it right there, in bfloat16, before the
uses are added (sudoku-mlp: 7 uses x 2 layers, 71.8 MB of bfloat16 per step for 5.03M weights).
XLA's all-reduce reassociation does not merge them across the float32 converts between the
all-reduces and the adds. So the step here says what it means: during a training forward
(`per_device_weight_grads`), every `model.Linear` holds a float32 view of its weight broadcast to
[devices, out, in] and split over the data axis like the batch. Each use's backward computes its
weight gradient per device, as a batched matmul of that device's own rows ([devices, out, in],
rounded to the activation dtype as the reference's is, then float32), so nothing crosses devices;
the uses accumulate on the view in float32, and the broadcast's backward (a sum over the devices
axis) is the one float32 all-reduce per weight. The forward values are unchanged: the same matmul
with the same cast weight.

With one device, or outside `per_device_weight_grads` (evaluation, CPU eager), `model.Linear` takes
autograd's own path. This file never imports torch_xla: the split over the data axis is the
`split` function the trainer passes (sharding.shard_batch_dim).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class _Use(torch.autograd.Function):
    """One use of a weight: forward `x @ w.T` ("right") or `w @ x` ("left", x [batch, in, c]),
    with `w` the cast weight. Backward: x's gradient as autograd computes it, and the weight's as
    per-device gradients for `view` [devices, out, in] (w gets none: it reaches the weight
    through the view)."""

    @staticmethod
    def forward(ctx, x, w, view, bias, side: str, annotate):
        ctx.save_for_backward(x, w)
        ctx.side, ctx.annotate, ctx.devices, ctx.view_dtype = side, annotate, view.shape[0], view.dtype
        return F.linear(x, w, bias) if side == "right" else torch.matmul(w, x)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        devices = ctx.devices
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        # Each device's rows: the batch dim split as [devices, rows per device] (a free view of
        # the major dim), contracted over rows and positions as they lie, never merged into one
        # dim (on a TPU, merging rows with 97 positions is a relayout copy of the activations).
        rows_dy, rows_x = (t.view(devices, -1, *t.shape[1:]) for t in (dy, x))
        if ctx.side == "right":  # y [b, (s,) out] = x [b, (s,) in] @ w.T (+ bias)
            dx = torch.matmul(dy, w) if ctx.needs_input_grad[0] else None
            spec = "dbso,dbsi->doi" if x.ndim == 3 else "dbo,dbi->doi"
        else:  # y [b, out, c] = w [out, in] @ x [b, in, c]
            dx = torch.matmul(w.transpose(0, 1), dy) if ctx.needs_input_grad[0] else None
            spec = "dboc,dbic->doi"
        parts = torch.einsum(spec, rows_dy, rows_x)  # [devices, out, in] in x's dtype: rounded as the reference's
        return dx, None, ctx.annotate(parts).to(ctx.view_dtype), dbias, None, None


def use(module: nn.Module, x: torch.Tensor, side: str = "right", part: int = 0, parts: int = 1) -> torch.Tensor:
    """`x @ W.T (+ b)` (side "right") or `W @ x` ("left") with W the row block `part` of `parts`
    of the module's float32 weight and b its bias (if any, right side, whole weight only), both
    cast to x's dtype; per-device weight gradients when the module holds a view
    (`per_device_weight_grads`) and autograd records this use."""
    weight = module.weight.to(x.dtype)
    if parts > 1:
        weight = weight.chunk(parts, dim=0)[part]
    bias = None if getattr(module, "bias", None) is None else module.bias.to(x.dtype)
    view = getattr(module, "device_view", None)
    if view is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias) if side == "right" else torch.matmul(weight, x)
    if parts > 1:
        view = view.chunk(parts, dim=1)[part]
    return _Use.apply(x, weight.detach(), view, bias, side, module.device_annotate)


@contextmanager
def per_device_weight_grads(model: nn.Module, devices: int, split: Callable[[torch.Tensor], torch.Tensor]):
    """Within: each weight of `model`'s modules that route their matmuls through `use` (the
    modules with a `device_view` attribute, model.Linear) gets its gradient summed per device over
    its uses, then over the `devices` once, in float32 (see the module docstring). `split`
    annotates a tensor as split on dim 0 over the data axis. Nothing changes with one device.
    The forward and backward of one training step both run inside."""
    linears = [m for m in model.modules() if hasattr(m, "device_view")]
    if devices > 1:
        for m in linears:
            m.device_view = split(m.weight.unsqueeze(0).expand(devices, *m.weight.shape))
            m.device_annotate = split
    try:
        yield
    finally:
        for m in linears:
            m.device_view = m.device_annotate = None
