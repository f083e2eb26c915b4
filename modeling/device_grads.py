"""Dense weight gradients reduced as the reference reduces them: each device sums a weight's uses
in float32, then the devices sum once, in float32.

The reference keeps float32 weights and casts them to bfloat16 at every use (`CastedLinear`). On
G GPUs (torchrun, one process each, no DDP wrapper), each use's weight gradient is the bfloat16
matmul of that GPU's rows, rounded to bfloat16 once; the cast's backward turns it into float32 and
autograd adds the uses in float32; then its pretrain.py (`train_batch`) all-reduces each
`param.grad` by hand (`dist.all_reduce`), the float32 sum across GPUs, once per weight.

Left to itself, XLA's SPMD partitioner computes each use's bfloat16 weight-gradient matmul as a
partial sum over the device's rows and all-reduces it right there, in bfloat16, before the
uses are added (one all-reduce per use and weight: docs/measurements.md has sudoku-mlp's bytes).
XLA's all-reduce reassociation does not merge them across the float32 converts between the
all-reduces and the adds. So the step here says what it means: during a training forward
(`per_device_weight_grads`), every `model.Linear` holds a float32 view of its weight broadcast to
[devices, out, in] and split over the data axis like the batch. Each use's backward computes its
weight gradient per device, as a batched matmul of that device's own rows ([devices, out, in],
rounded to the activation dtype as the reference's is, then float32), so nothing crosses devices;
the uses accumulate on the view in float32, and the broadcast's backward (a sum over the devices
axis) is the one float32 all-reduce per weight. The forward values are unchanged: the same matmul
with the same cast weight.

Every product with such a weight goes through `weight_matmul`. Within a sharded step any other
operation on one of those weights (e.g. `F.linear(x, linear.weight)`, whose gradient would go
back to one bfloat16 all-reduce per use) raises, naming the module; so does a torch.nn.Linear in
the model (its matmul is not weight_matmul's), and a bias with a product it does not add to.

With one device, or outside `per_device_weight_grads` (evaluation, CPU eager), `model.Linear` takes
autograd's own path. This file never imports torch_xla: the split over the data axis is the
`split` function the trainer passes (sharding.shard_batch_dim).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class _Use(torch.autograd.Function):
    """Uses of a weight's `parts` row blocks w_1..w_p (one use when p is 1): forward each
    block's `x @ w_i.T` ("right") or `w_i @ x` ("left", x [batch, in, c]), with `w` the cast
    weight. Backward: x's gradient, and the weight's: per device for `view` [devices, out, in]
    when there is one (w then gets none: it reaches the weight through the view), else for w.

    x's gradient from several blocks is their matmuls summed in float32 and rounded once: the
    reference's one matmul of the whole weight accumulates the blocks' products in float32 and
    rounds once, where rounding each block's to the activation dtype and adding those (autograd's
    sum over separate uses) rounds at every block and every add (tests/test_archs.py: bf16
    gradients equal the reference's bitwise; 3.1e-2 of the largest apart before)."""

    @staticmethod
    def forward(ctx, x, w, view, bias, side: str, annotate, parts: int):
        ctx.save_for_backward(x, w)
        ctx.side, ctx.annotate, ctx.parts = side, annotate, parts
        ctx.devices, ctx.view_dtype = (1, None) if view is None else (view.shape[0], view.dtype)
        return _matmuls(x, w, bias, side, parts)

    @staticmethod
    def backward(ctx, *dys):
        x, w = ctx.saved_tensors
        blocks = w.chunk(ctx.parts, dim=0)
        right = ctx.side == "right"  # (an output unused gets zeros: autograd materialises them)
        dx = None
        if ctx.needs_input_grad[0]:  # y = x @ w.T: dx = dy @ w;  y = w @ x: dx = w.T @ dy
            wide = (lambda t: t) if ctx.parts == 1 else (lambda t: t.float())
            terms = [torch.matmul(wide(dy), wide(b)) if right else torch.matmul(wide(b).transpose(0, 1), wide(dy))
                     for dy, b in zip(dys, blocks)]
            dx = terms[0] if ctx.parts == 1 else sum(terms[1:], terms[0]).to(x.dtype)
        dbias = dys[0].reshape(-1, dys[0].shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        # Each device's rows: the batch dim split as [devices, rows per device] (a free view of
        # the major dim), contracted over rows and positions as they lie, never merged into one
        # dim (on a TPU, merging rows with 97 positions is a relayout copy of the activations).
        devices = ctx.devices
        rows_x = x.view(devices, -1, *x.shape[1:])
        spec = ("dbso,dbsi->doi" if x.ndim == 3 else "dbo,dbi->doi") if right else "dboc,dbic->doi"
        # [devices, out, in] in x's dtype, each block's rounded as the reference's
        grads = torch.cat([torch.einsum(spec, dy.view(devices, -1, *dy.shape[1:]), rows_x) for dy in dys], dim=1)
        if ctx.view_dtype is None:
            return dx, grads[0], None, dbias, None, None, None
        return dx, None, ctx.annotate(grads).to(ctx.view_dtype), dbias, None, None, None


def _matmuls(x: torch.Tensor, w: torch.Tensor, bias, side: str, parts: int):
    """Each of w's `parts` row blocks times x (a tuple when parts > 1)."""
    outs = tuple(F.linear(x, b, bias) if side == "right" else torch.matmul(b, x) for b in w.chunk(parts, dim=0))
    return outs if parts > 1 else outs[0]


_reading_weight = False  # inside weight_matmul (_WeightsOnlyThroughWeightMatmul lets its operations pass)


def weight_matmul(module: nn.Module, x: torch.Tensor, side: str = "right", parts: int = 1):
    """`x @ W.T (+ b)` (side "right") or `W @ x` ("left") with W the module's float32 weight and
    b its bias (right side, one part only), both cast to x's dtype; with `parts` > 1, a tuple:
    one result per row block of W (the same dot products as one matmul split after, without
    writing the whole result and slicing it). Per-device weight gradients when the module holds
    a view (`per_device_weight_grads`) and autograd records this product."""
    global _reading_weight
    if side not in ("right", "left"):
        raise ValueError(f"weight_matmul: side={side!r}; use 'right' (x @ W.T) or 'left' (W @ x)")
    if getattr(module, "bias", None) is not None and (parts > 1 or side == "left"):
        raise ValueError(f"weight_matmul: a module with a bias and {'parts > 1' if parts > 1 else 'side left'}: "
                         "the bias would not be added; give the module bias=False (and add the bias "
                         "yourself), or use side 'right' with one part")
    _reading_weight = True  # (in float32 the cast is the weight itself)
    try:
        weight = module.weight.to(x.dtype)
        bias = None if getattr(module, "bias", None) is None else module.bias.to(x.dtype)
        view = getattr(module, "device_view", None)
        if not torch.is_grad_enabled() or (view is None and parts == 1):
            return _matmuls(x, weight, bias, side, parts)
        return _Use.apply(x, weight if view is None else weight.detach(), view, bias, side,
                          module.device_annotate, parts)
    finally:
        _reading_weight = False


class _WeightsOnlyThroughWeightMatmul(TorchFunctionMode):
    """Within a sharded step: a torch operation on one of the guarded weights other than
    weight_matmul's own raises, naming the module. Attribute reads pass (.shape, .grad), unless
    they are a differentiable view of the weight (.T, .mT)."""

    def __init__(self, owners: dict[int, tuple[str, torch.Tensor]]):
        super().__init__()
        self.owners = owners  # id(weight) -> (module name, weight): the weight kept alive, its id unique

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = None if _reading_weight else next(
            (owner[0] for arg in (*args, *kwargs.values())
             for tensor in (arg if isinstance(arg, (list, tuple)) else (arg,))
             if (owner := self.owners.get(id(tensor))) is not None and owner[1] is tensor), None)
        getter = getattr(func, "__name__", "") == "__get__"
        if name is not None and not getter:
            raise _bypass(name, func)
        result = func(*args, **kwargs)
        if name is not None and isinstance(result, torch.Tensor) and result.grad_fn is not None:
            raise _bypass(name, func)
        return result


def _bypass(name: str, func) -> RuntimeError:
    name = name or "the model"
    what = getattr(func, "__name__", repr(func))  # an attribute's getter: the attribute's name
    what = getattr(getattr(func, "__self__", None), "__name__", what) if what == "__get__" else what
    return RuntimeError(
        f"{name}.weight used by {what} outside device_grads.weight_matmul "
        "in a sharded training step: its gradient would be all-reduced in bfloat16 at this use instead "
        f"of summed per device in float32 (modeling/device_grads.py); compute it as weight_matmul({name}, x, ...) "
        "(model.Linear's forward does)")


@contextmanager
def per_device_weight_grads(model: nn.Module, devices: int, split: Callable[[torch.Tensor], torch.Tensor]):
    """Within: each weight of `model`'s modules that route their matmuls through `weight_matmul`
    (the modules with a `device_view` attribute, model.Linear) gets its gradient summed per device
    over its uses, then over the `devices` once, in float32 (see the module docstring); any other
    use of those weights raises. `split` annotates a tensor as split on dim 0 over the data axis.
    Nothing changes with one device. The forward and backward of one training step both run inside."""
    modules = dict(model.named_modules())
    plain = [name or "the model" for name, m in modules.items() if isinstance(m, nn.Linear)]
    if plain:
        raise TypeError(f"{', '.join(plain)}: torch.nn.Linear, whose weight's gradient would be "
                        "all-reduced in bfloat16 at each use in a sharded step; use model.Linear "
                        "(its products go through device_grads.weight_matmul)")
    linears = {name: m for name, m in modules.items() if hasattr(m, "device_view")}
    guard = contextlib.nullcontext()
    if devices > 1:
        for m in linears.values():
            m.device_view = split(m.weight.unsqueeze(0).expand(devices, *m.weight.shape))
            m.device_annotate = split
        guard = _WeightsOnlyThroughWeightMatmul({id(m.weight): (name, m.weight) for name, m in linears.items()})
    try:
        with guard:
            yield
    finally:
        for m in linears.values():
            m.device_view = m.device_annotate = None
