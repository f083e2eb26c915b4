"""The optimizers of TRM and the EMA of its weights, in plain PyTorch (no torch_xla).

AdamATan2 (the `adam-atan2` 0.0.3 kernel's rule, the reference's optimizer for the dense
weights; torch's Adam and AdamW are the alternatives a study compares, and URM's Muon the
optimizer of its ARC-AGI-2 recipe, `dense_optimizer`),
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


MUON_NS_COEFFICIENTS = ((7.2086, -15.5131, 9.0178), (3.9623, -2.5813, 0.4542), (3.9466, -2.5765, 0.4544),
                        (3.8991, -2.5671, 0.4566), (3.7186, -2.5308, 0.4653), (3.1390, -2.3073, 0.4733),
                        (2.1715, -1.5246, 0.3885), (1.8648, -1.2224, 0.3577))
"""(a, b, c) of each Newton-Schulz iteration of URM's Muon (its models/muon.py), the last one
repeated past the eighth; torch.optim.Muon has one tuple, (3.4445, -4.7750, 2.0315), for all."""


def orthogonalized(update: torch.Tensor, steps: int) -> torch.Tensor:
    """URM's Muon's approximate orthogonalisation of a 2-D update: rounded to bfloat16 once, then
    in float32 (torch.optim.Muon iterates in bfloat16), taken wide (transposed when it has more
    rows than columns), divided by its Frobenius norm (at least 1e-7), then `steps` iterations
    X <- a X + (b A + c A A) X, A = X X^T, with MUON_NS_COEFFICIENTS. (URM fuses the sums into
    torch.addmm; traced on the sharded CPU mesh, torch_xla 2.9 crashes on those addmm calls.)"""
    x = update.to(torch.bfloat16).float()
    transpose = x.shape[-2] > x.shape[-1]
    x = x.mT if transpose else x
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-7)
    for i in range(steps):
        a, b, c = MUON_NS_COEFFICIENTS[min(i, len(MUON_NS_COEFFICIENTS) - 1)]
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if transpose else x


class Muon(torch.optim.Optimizer):
    """URM's Muon (github.com/UbiquantAI/URM, models/muon.py; our own code, its rule) with URM's
    parameter split (its pretrain.py with use_muon): every 2-D parameter by Muon, the others (the Q
    head's bias, the ConvSwiGLU's conv) by its AdamW; both at the same lr and weight decay.

        Muon (2-D):  buf <- mu buf + g;  u = g + mu buf (nesterov);  O = orthogonalized(u, ns_steps)
                     p <- p (1 - lr wd) - lr * matched_rms * sqrt(max(rows, cols)) * O
        AdamW:       m <- lerp(m, g, 1-b1);  v <- lerp(v, g^2, 1-b2)
                     p <- p (1 - lr wd) - lr sqrt(1-b2^t) / (1-b1^t) * m / (eps + sqrt(v))

    torch.optim.Muon (torch 2.9) differs: its momentum is an EMA, (1-mu) times URM's (the same
    direction after the normalisation); its Newton-Schulz iterations run in bfloat16 with one
    coefficient tuple for every step (URM's: float32, a schedule); with adjust_lr_fn
    "match_rms_adamw" its lr scaling and its decoupled weight decay are URM's; it refuses non-2-D
    parameters. `lr` may be a device tensor (written into both groups every step); every state
    tensor exists before the first step (`init_state`), so a traced step is the same graph."""

    def __init__(self, params, lr: float | torch.Tensor = 0.0, betas=(0.9, 0.95), weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, matched_rms: float = 0.2,
                 eps: float = 1e-8):
        if weight_decay < 0:
            raise ValueError(f"Muon weight_decay must be >= 0, got {weight_decay}")
        params = list(params)
        groups = [{"params": [p for p in params if p.ndim == 2], "use_muon": True},
                  {"params": [p for p in params if p.ndim != 2], "use_muon": False}]
        super().__init__([g for g in groups if g["params"]],
                         dict(lr=lr, betas=betas, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                              ns_steps=ns_steps, matched_rms=matched_rms, eps=eps))

    def init_state(self):
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    continue
                if group["use_muon"]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                else:
                    init_state_of(self, p)

    @torch.no_grad()
    def step(self, closure=None):
        self.init_state()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    buf, mu = state["momentum_buffer"], group["momentum"]
                    buf.mul_(mu).add_(p.grad)
                    update = orthogonalized(p.grad.add(buf, alpha=mu) if group["nesterov"] else buf,
                                            group["ns_steps"])
                    p.mul_(1 - lr * decay)
                    p.sub_(lr * (group["matched_rms"] * max(p.shape[0], p.shape[1]) ** 0.5) * update)
                else:
                    beta1, beta2 = group["betas"]
                    state["step"].add_(1)
                    t = state["step"]
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    m.lerp_(p.grad, 1 - beta1)
                    v.lerp_(p.grad.square(), 1 - beta2)
                    p.mul_(1 - lr * decay)
                    p.sub_((lr * (1 - beta2 ** t).sqrt() / (1 - beta1 ** t)) * (m / (group["eps"] + v.sqrt())))


DENSE_OPTIMIZERS = ("adam_atan2", "adamw", "adam", "muon")
"""The optimizers of the dense weights: the paper's AdamATan2, torch's AdamW (decoupled weight
decay) and Adam (weight decay added to the gradient, as torch.optim.Adam does), URM's Muon
(2-D weights; the others by its AdamW, eps 1e-8)."""


def dense_optimizer(params, name: str, betas=(0.9, 0.95), weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer of the dense weights, its state already created (`init_state`). torch's
    Adam and AdamW run capturable (their step count stays a device tensor, the bias corrections
    are device math) and unfused, one parameter at a time, so a tensor lr written into each param
    group every step keeps the traced graph the same; eps is torch's default, 1e-8."""
    if name == "adam_atan2":
        optimizer = AdamATan2(params, betas=betas, weight_decay=weight_decay)
    elif name == "muon":
        optimizer = Muon(params, betas=betas, weight_decay=weight_decay)
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
    if isinstance(optimizer, Muon):
        optimizer.init_state()
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                init_state_of(optimizer, p)


def init_state_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
    """One parameter's Adam-like state: step (a float32 device scalar), exp_avg, exp_avg_sq."""
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


