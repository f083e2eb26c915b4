"""The optimizers of TRM and the EMA of its weights, in plain PyTorch (no torch_xla).

AdamATan2 (the `adam-atan2` 0.0.3 kernel's rule, the reference's optimizer for the dense
weights; torch's Adam and AdamW are the alternatives a study compares, `dense_optimizer`),
SignSGD for the sparse puzzle-embedding table, and the exponential moving average used for
evaluation and export. Learning rates may be device tensors and every state tensor exists
before the first step, so a traced step is the same graph every time.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from model import SparseEmbedding


class AdamATan2(torch.optim.Optimizer):
    """Adam with atan2 in place of m / (sqrt(v) + eps) (no epsilon), decoupled weight decay:
    the rule of the `adam-atan2` 0.0.3 CUDA kernel the reference trains with.

        θ ← θ(1 - ηλ);  m ← lerp(m, g, 1-β1);  v ← lerp(v, g², 1-β2)
        θ ← θ - (η / (1-β1^t)) · atan2(m, sqrt(v) / sqrt(1-β2^t))

    The first bias correction scales the step outside atan2 (moving it inside would change
    the first update by up to 27%).

    `lr` may be a 0-d tensor on the parameters' device: write a new value into each param
    group's "lr" every step and the traced graph stays the same. The step count t is a device
    tensor for the same reason.
    """

    def __init__(self, params, lr: float | torch.Tensor = 0.0, betas=(0.9, 0.95), weight_decay: float = 0.0):
        # The bias corrections 1 - beta^t are float32 device values: a beta that rounds to 1.0
        # in float32 would divide by zero.
        if not all(0.0 <= b and float(torch.tensor(b, dtype=torch.float32)) < 1.0 for b in betas):
            raise ValueError(f"AdamATan2 betas must be in [0, 1) and below 1 in float32 "
                             f"(at most 0.99999994), got {betas}")
        if weight_decay < 0:
            raise ValueError(f"AdamATan2 weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def init_state(self):
        init_state(self)

    @torch.no_grad()
    def step(self, closure=None):
        init_state(self)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"].add_(1)
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * decay)
                m.lerp_(p.grad, 1 - beta1)
                v.lerp_(p.grad.square(), 1 - beta2)
                step_size = lr / (1 - beta1 ** t)
                p.sub_(step_size * torch.atan2(m, v.sqrt() / (1 - beta2 ** t).sqrt()))


DENSE_OPTIMIZERS = ("adam_atan2", "adamw", "adam")
"""The optimizers of the dense weights: the paper's AdamATan2, torch's AdamW (decoupled weight
decay) and Adam (weight decay added to the gradient, as torch.optim.Adam does)."""


def dense_optimizer(params, name: str, betas=(0.9, 0.95), weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer of the dense weights, its state already created (`init_state`). torch's
    Adam and AdamW run capturable (their step count stays a device tensor, the bias corrections
    are device math) and unfused, one parameter at a time, so a tensor lr written into each param
    group every step keeps the traced graph the same; eps is torch's default, 1e-8."""
    if name == "adam_atan2":
        optimizer = AdamATan2(params, betas=betas, weight_decay=weight_decay)
    elif name in ("adam", "adamw"):
        optimizer = torch.optim.Adam(params, lr=0.0, betas=betas, weight_decay=weight_decay, capturable=True,
                                     foreach=False, decoupled_weight_decay=name == "adamw")
    else:
        raise ValueError(f"unknown optimizer {name!r}: use one of {', '.join(DENSE_OPTIMIZERS)}")
    init_state(optimizer)
    return optimizer


@torch.no_grad()
def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an Adam-like optimizer's state (step, exp_avg, exp_avg_sq, as torch's Adam names
    them) now rather than at the first step, so that the first step traces the same graph as
    every later one."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class SignSGD:
    """The reference's optimizer for the sparse puzzle embedding, with static shapes.

    For every id in the (global) batch: row ← row(1 - ηλ) - η·sign(Σ of that id's gradients over
    the batch). Instead of `unique` (whose output size depends on the data), every row finds the
    first row of the batch with its id (an id-equality matrix [B, B]), the gradients are added
    into that row's slot (index_add: exact float32 sums, where a matmul would run at the
    backend's default precision, bf16 inputs on a TPU, and spread one NaN row to every row),
    and every duplicate writes the same new row. No state; rows not in the batch are untouched.
    """

    def __init__(self, embedding: SparseEmbedding, lr: float | torch.Tensor = 0.0, weight_decay: float = 0.0):
        if weight_decay < 0:
            raise ValueError(f"SignSGD weight_decay must be >= 0, got {weight_decay}")
        self.embedding = embedding
        self.lr = lr
        self.weight_decay = weight_decay

    @torch.no_grad()
    def step(self):
        rows, ids = self.embedding.batch_rows, self.embedding.batch_ids
        if rows is None or rows.grad is None:
            return
        positions = torch.arange(ids.shape[0], device=ids.device)
        same_id = ids.unsqueeze(0) == ids.unsqueeze(1)
        first = torch.where(same_id, positions, ids.shape[0]).amin(dim=1)
        grad_sum = torch.zeros_like(rows.grad).index_add_(0, first, rows.grad).index_select(0, first)
        new_rows = rows * (1 - self.lr * self.weight_decay) - self.lr * torch.sign(grad_sum)
        self.embedding.weight.index_copy_(0, ids.long(), new_rows)

    def zero_grad(self):
        self.embedding.batch_rows = self.embedding.batch_ids = None


class EMA:
    """Exponential moving average of the trainable parameters (not of buffers such as the
    puzzle-embedding table, which the reference does not average either)."""

    def __init__(self, model: nn.Module, rate: float = 0.999):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"EMA rate must be in [0, 1), got {rate}")
        self.rate = rate
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: nn.Module):
        for name, p in model.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach(), 1 - self.rate)

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module):
        """Within the block, `model` holds the averaged weights (no copy: the tensors swap)."""
        def swap():
            for name, p in model.named_parameters():
                if name in self.shadow:
                    p.data, self.shadow[name] = self.shadow[name], p.data
        swap()
        try:
            yield model
        finally:
            swap()

    @torch.no_grad()
    def copy_to(self, model: nn.Module):
        """Write the averaged weights into `model` (same architecture)."""
        for name, p in model.named_parameters():
            if name in self.shadow:
                p.copy_(self.shadow[name])


