"""The Tiny Recursive Model (TRM, arXiv 2510.04871) in plain PyTorch.

Same math as the reference implementation (github.com/SamsungSAILMontreal/TinyRecursiveModels):
the blocks, embeddings and heads every arch shares, the ACT carry, the stablemax loss with the
Q-halt head (each arch's recursion is modeling/schemes.py's; the reference's checkpoints
reference/weights.py's; the optimizers and the EMA training/optim.py's; the FLOP count tpu_costs/run_costs.py's).
Everything here keeps static shapes and never reads a device value on the host, so one training
step traces to one XLA graph. This file never imports torch_xla: it runs the same on CPU eager
and on XLA.

    model = TRM(TRMConfig(seq_len=81, vocab_size=11, num_puzzle_identifiers=1))
    carry = model.initial_carry(batch)
    carry, outputs = model(carry, batch)
    loss, metrics = loss_and_metrics(carry, outputs)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from modeling import schemes
from modeling.attention import ATTENTIONS, attend
from modeling.counter_hash import hashed_keys, hashed_uniform  # noqa: F401 (model.hashed_uniform: the exploration's draws)
from modeling.device_grads import weight_matmul
from modeling.field_ranges import range_problems, ranged
from modeling.schemes import SCHEMES, exploration_prob

IGNORE_LABEL_ID = -100
"""The label of a position without a target: the loss and the metrics skip it (torch's
cross-entropy ignore_index). data.py writes the same value into its batches' labels."""

DRAWS_STREAM = 2
"""hashed_keys' stream of a drawing scheme's per-row keys (the halting exploration's are 0 and 1)."""

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class TRMConfig:
    """Architecture of a TRM; field names follow the reference's arch config."""

    arch: schemes.ArchName = "trm"
    """The architecture, a recursion scheme registered in modeling/schemes.py; choosing one sets its yaml's values unless flags set them."""  # noqa: E501 (one line: tyro keeps line breaks)
    seq_len: int = ranged(81, ge=1)
    """Tokens per example (from the dataset)."""
    vocab_size: int = ranged(11, ge=1)
    """Token vocabulary size including pad (from the dataset)."""
    num_puzzle_identifiers: int = ranged(1, ge=1)
    """Rows of the puzzle-embedding table (from the dataset)."""
    hidden_size: int = ranged(512, ge=1)
    """Width of every token state."""
    num_heads: int = ranged(8, ge=1)
    """Attention heads of width hidden_size // num_heads, as the reference (unused when mlp_t)."""
    expansion: float = ranged(4.0, gt=0)
    """SwiGLU expansion; inner width is round(expansion*2/3*width) rounded up to 256."""
    H_cycles: int = ranged(3, ge=1)
    """Outer recursions per ACT step (trm: the first H_cycles-1 without gradient; the baseline has none)."""
    L_cycles: int = ranged(6, ge=1)
    """Latent updates z_L per outer recursion (trm_hier6: at most 6, one per slot)."""
    L_layers: int = ranged(2, ge=1)
    """Blocks in the one shared network (hrm: in the L network)."""
    H_layers: int = ranged(0, ge=0)
    """Blocks in the H network of hrm and transformers_baseline (ignored by the others)."""
    separate_H_L: bool = False
    """trm only: z_H updated by a second network of L_layers blocks (the paper's "separate f_H, f_L")."""
    one_step_grad: bool = False
    """trm only: gradient through the last L and H update only (the paper's "1-step gradient", HRM's)."""
    mlp_t: bool = False
    """Replace attention by a SwiGLU across the sequence (TRM-MLP)."""
    conv_kernel: int = ranged(0, ge=0, note="0 = the plain SwiGLU")
    """Kernel of a depthwise conv over positions inside each block's SwiGLU (URM's ConvSwiGLU: 2, causal); 0: the plain SwiGLU."""  # noqa: E501 (one line: tyro keeps line breaks)
    pos_encodings: Literal["rope", "rope2d", "learned", "none"] = "rope"
    """Position encoding: rope, rope2d (EqR's: the rows and columns of a square board), learned, or none."""
    puzzle_emb_ndim: int = ranged(512, ge=0, note="0 disables the puzzle embedding")
    """Width of a puzzle-embedding row (0 disables the puzzle embedding)."""
    puzzle_emb_len: int = ranged(16, ge=0, note="0 sizes it from puzzle_emb_ndim")
    """Prefix positions reserved for the puzzle embedding (0: ceil(puzzle_emb_ndim/hidden_size))."""
    halt_max_steps: int = ranged(16, ge=1)
    """ACT steps after which a sequence always halts (and the exact count in evaluation)."""
    halt_exploration_prob: float = ranged(0.1, ge=0, le=1, note="a probability")
    """Probability that a training sequence gets a random minimum of 2..halt_max_steps steps."""
    halt_exploration_final: float | None = ranged(None, ge=0, le=1, note="a probability; leave it out for none")
    """Anneal the exploration probability linearly to this (modeling/schemes.py); None: no anneal."""
    halt_exploration_anneal_steps: int = ranged(0, ge=0, note="0 = the steps of optim.epochs")
    """Training steps the anneal to halt_exploration_final takes (0: the steps of optim.epochs)."""
    no_ACT_continue: bool = True
    """Halt on sigmoid(q_halt) > 0.5 only; False: on q_halt > q_continue, with the reference's
    Q-continue target and loss (hrm; transformers_baseline without the target)."""
    act_enabled: bool = True
    """Halt on the Q head in training (transformers_baseline's field; False: always halt_max_steps)."""
    act_inference: bool = False
    """transformers_baseline's field: halt on the Q head in evaluation too (not supported: False)."""
    eqr_damping: float = ranged(0.95, gt=0, le=1, note="EqR's lambda_; other archs keep 0.95")
    """eqr only: λ in (0, 1] of every update z <- (1-λ)·z + λ·f(z + injection) + σ·ε (EqR's lambda_)."""
    eqr_noise: float = ranged(0.01, ge=0, note="EqR's noise_scale; other archs keep 0.01")
    """eqr only: σ >= 0 of the noise σ·ε of every update, ε standard normal, in evaluation too (EqR's noise_scale)."""
    forward_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Activation dtype (weights stay float32)."""
    rms_norm_eps: float = ranged(1e-5, gt=0)
    """Epsilon of the RMSNorm (computed in float32)."""
    rope_theta: float = ranged(10000.0, gt=0)
    """RoPE base."""
    attention: Literal["blockwise", "sdpa"] = ranged("blockwise", resumable=True)
    """How attention is computed (modeling/attention.py; the same math): blockwise, over blocks of keys
    (no [batch, heads, seq, seq] tensor when seq > attention_block); sdpa, torch's call as in the reference."""
    attention_block: int = ranged(512, ge=1, resumable=True)
    """Keys per block of the blockwise attention; a sequence within one block is computed at once
    (faster where it fits in HBM: tpu_compile.py tells; smaller blocks need less memory)."""

    def problems(self, ranges: bool = True) -> list[str]:
        """What is wrong with these values, empty if nothing: the ranges declared on the fields
        ("name=value must be ..."; left out with ranges=False, for callers that report
        range_problems themselves), then the checks that involve several fields. TRM() raises
        them; config.check_config reports them (as flags) before a run starts."""
        out = [f"{name}={value!r} must be {rule}" + (f" ({note})" if note else "")
               for name, value, rule, note in range_problems(self)] if ranges else []
        if self.pos_encodings not in ("rope", "rope2d", "learned", "none"):
            out.append(f"pos_encodings must be rope, rope2d, learned or none, got {self.pos_encodings!r}")
        if self.forward_dtype not in DTYPES:
            out.append(f"forward_dtype must be one of {sorted(DTYPES)}, got {self.forward_dtype!r}")
        if self.attention not in ATTENTIONS:
            out.append(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.arch not in SCHEMES:
            out.append(f"arch must be one of {', '.join(SCHEMES)} (modeling/schemes.py's registered schemes), "
                       f"got {self.arch!r}")
        if out or range_problems(self):  # the checks below divide by these sizes
            return out
        out += self.scheme.config_problems(self)
        if self.act_inference:
            out.append("act_inference=True: evaluation runs every halt_max_steps step here, as the "
                       "reference's default; halting early in evaluation is not supported")
        head_dim = self.hidden_size // self.num_heads
        if not self.mlp_t and (head_dim == 0 or (self.pos_encodings == "rope" and head_dim % 2)):
            out.append(f"num_heads={self.num_heads} gives heads of width hidden_size // num_heads = {head_dim}"
                       + (", odd: RoPE rotates pairs" if head_dim else "") + "; use fewer heads")
        if self.pos_encodings == "rope2d":
            side = math.isqrt(self.seq_len)
            if (not self.mlp_t and head_dim % 4) or side * side != self.seq_len or self.prefix_len:
                out.append(f"pos_encodings='rope2d' rotates each head's halves by a square board's row and column: "
                           f"it needs heads of a width divisible by 4 (got {head_dim}), seq_len a square (got "
                           f"{self.seq_len}) and no puzzle prefix (got {self.prefix_len} positions)")
        if self.puzzle_emb_ndim > self.prefix_len * self.hidden_size:
            out.append(f"puzzle_emb_ndim={self.puzzle_emb_ndim} does not fit in puzzle_emb_len="
                       f"{self.puzzle_emb_len} positions of width {self.hidden_size}; raise "
                       "puzzle_emb_len or set it to 0")
        return out

    @property
    def scheme(self) -> schemes.RecursionScheme:
        """The arch's recursion scheme (modeling/schemes.py)."""
        return SCHEMES[self.arch]

    def halt_score(self, q_halt: torch.Tensor, q_continue: torch.Tensor | None = None) -> torch.Tensor:
        """The Q head's logits as this arch reads them for halting: a row halts where the score is
        > 0, a higher score a surer halt (RecursionScheme.halt_score: q_halt, or q_halt - q_continue)."""
        return self.scheme.halt_score(self, q_halt, q_continue)

    @property
    def prefix_len(self) -> int:
        """Positions in front of the tokens that hold the puzzle embedding."""
        if self.puzzle_emb_len:
            return self.puzzle_emb_len
        return -(-self.puzzle_emb_ndim // self.hidden_size)

    @property
    def total_len(self) -> int:
        return self.seq_len + self.prefix_len

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.forward_dtype]


# ----------------------------------------------------------------------------------------------
# Layers


def truncated_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """JAX-style truncated normal on [-2, 2] standard deviations whose *actual* std is `std`.

    torch.nn.init.trunc_normal_ truncates a N(0, std) and so ends up narrower; the reference
    corrects the scale so that the truncated distribution has the requested std.
    """
    with torch.no_grad():
        if std == 0:
            return tensor.zero_()
        lo, hi = -2.0, 2.0
        cdf_lo, cdf_hi = math.erf(lo / math.sqrt(2)), math.erf(hi / math.sqrt(2))
        mass = (cdf_hi - cdf_lo) / 2
        pdf = lambda x: math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        var_truncated = 1 - (hi * pdf(hi) - lo * pdf(lo)) / mass - ((pdf(lo) - pdf(hi)) / mass) ** 2
        scale = std / math.sqrt(var_truncated)
        tensor.uniform_(cdf_lo, cdf_hi).erfinv_().mul_(math.sqrt(2) * scale)
        return tensor.clamp_(lo * scale, hi * scale)


def rms_norm(x: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    """RMSNorm over `dim` without a gain, computed in float32 and returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().mean(dim, keepdim=True) + eps)).to(x.dtype)


def swiglu_width(width: int, expansion: float) -> int:
    return -(-round(expansion * width * 2 / 3) // 256) * 256


class Linear(nn.Module):
    """y = x W^T (+ b) with float32 weights cast to the activation dtype; LeCun truncated init.
    Every matmul with the weight goes through device_grads.weight_matmul, which gives the weight's
    gradient the reference's reduction in a sharded training step (modeling/device_grads.py; another use
    of the weight there is an error)."""

    def __init__(self, fan_in: int, fan_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(truncated_normal_(torch.empty(fan_out, fan_in), std=fan_in ** -0.5))
        self.bias = nn.Parameter(torch.zeros(fan_out)) if bias else None
        self.device_view = self.device_annotate = None  # set by device_grads during a training step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weight_matmul(self, x)


class SwiGLU(nn.Module):
    """down(silu(gate) * up), gate and up the two halves of gate_up (the reference's SwiGLU)."""

    def __init__(self, width: int, expansion: float):
        super().__init__()
        inner = swiglu_width(width, expansion)
        self.gate_up = Linear(width, 2 * inner)
        self.down = Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up by two matmuls with the halves of gate_up's weight: the same dot products
        # as one matmul chunked after, without writing (and slicing) the double-width output.
        gate, up = weight_matmul(self.gate_up, x, parts=2)
        return self.down(F.silu(gate) * up)

    def across_positions(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x.transpose(1, 2)).transpose(1, 2) for x [batch, positions, channels]: the same
        dot products contracting the positions directly, with no transposed copy (on a TPU a minor
        dimension of T = 97 positions is padded to 128 and relaid out around every matmul)."""
        gate, up = weight_matmul(self.gate_up, x, "left", parts=2)
        return weight_matmul(self.down, F.silu(gate) * up, "left")


class ConvSwiGLU(SwiGLU):
    """URM's ConvSwiGLU (github.com/UbiquantAI/URM, models/layers.py; our own code):
    down(silu(conv(silu(gate) * up))), where conv is a depthwise convolution over positions with
    a bias, its kernel of k taps and the first T outputs of a zero padding of k // 2, so that

        conv(u)[t] = b + sum_j w[:, 0, j] * u[t - k//2 + j]      (u outside 0..T-1 is 0)

    (k = 2, URM's: w0 * u[t-1] + w1 * u[t] + b, causal). Written as products with shifted copies
    of u (static shapes, no matmul with the conv weight), in float32, rounded once to u's dtype.
    The weight [inner, 1, k] and bias [inner] are float32 parameters under URM's layout and
    start as torch's Conv1d does, U(-1/sqrt(k), 1/sqrt(k)) (URM keeps them in bfloat16)."""

    def __init__(self, width: int, expansion: float, kernel: int):
        super().__init__(width, expansion)
        inner, bound = swiglu_width(width, expansion), kernel ** -0.5
        self.conv_weight = nn.Parameter(torch.empty(inner, 1, kernel).uniform_(-bound, bound))
        self.conv_bias = nn.Parameter(torch.empty(inner).uniform_(-bound, bound))

    def conv(self, u: torch.Tensor) -> torch.Tensor:
        """The depthwise conv of u [batch, positions, inner] over positions, in float32."""
        length, kernel = u.shape[1], self.conv_weight.shape[-1]
        u32, weight = u.float(), self.conv_weight.float()
        out = None
        for j in range(kernel):
            shift = kernel // 2 - j  # tap j reads u[t - shift]
            shifted = F.pad(u32, (0, 0, max(shift, 0), max(-shift, 0)))[:, max(-shift, 0):max(-shift, 0) + length]
            term = weight[:, 0, j] * shifted
            out = term if out is None else out + term
        return out + self.conv_bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = weight_matmul(self.gate_up, x, parts=2)
        u = F.silu(gate) * up
        return self.down(F.silu(self.conv(u).to(u.dtype)))


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [length, head_dim] in the half-split layout the reference uses."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rope2d_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] of EqR's 2D RoPE on a square board (position t at row
    t // side, column t % side): the first half of a head is rope of width head_dim / 2 at the row,
    the second half at the column (apply_rope2d)."""
    side = math.isqrt(seq_len)
    cos, sin = rope_tables(head_dim // 2, side, theta)
    rows, cols = torch.arange(seq_len) // side, torch.arange(seq_len) % side
    return torch.cat([cos[rows], cos[cols]], dim=-1), torch.cat([sin[rows], sin[cols]], dim=-1)


def apply_rope2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """EqR's 2D RoPE of x [batch, seq, heads, head_dim] with rope2d_tables: each half of a head
    rotated as apply_rope does (pairs i, i + head_dim / 4 within the half), by its half of the tables."""
    half = x.shape[-1] // 2
    return torch.cat([apply_rope(x[..., :half], cos[:, :half], sin[:, :half]),
                      apply_rope(x[..., half:], cos[:, half:], sin[:, half:])], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] in float32, return it in its own dtype."""
    half = x.shape[-1] // 2
    # x·cos + rotate_half(x)·sin written per half (the tables' halves are equal): the same
    # products and sums, without a rotated float32 copy of x.
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Bidirectional multi-head self-attention, no bias; heads of width hidden_size // num_heads
    (their total may be narrower than hidden_size, as the reference allows: 12 heads of 42 on 512)."""

    def __init__(self, hidden_size: int, num_heads: int, kind: str = "blockwise", block: int = 512,
                 rope2d: bool = False):
        super().__init__()
        self.num_heads, self.kind, self.block = num_heads, kind, block
        self.rotate = apply_rope2d if rope2d else apply_rope
        self.head_dim = hidden_size // num_heads
        self.qkv = Linear(hidden_size, 3 * num_heads * self.head_dim)
        self.out = Linear(num_heads * self.head_dim, hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, length, _ = x.shape
        # q, k and v by three matmuls with the thirds of qkv's weight: the same dot products as one
        # matmul split after, without a backward that stacks their gradients into one copy.
        heads = (batch, length, self.num_heads, self.head_dim)
        q, k, v = (t.view(heads) for t in weight_matmul(self.qkv, x, parts=3))
        if rope is not None:
            q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v, self.kind, self.block)
        return self.out(y.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class Block(nn.Module):
    """Post-norm block: token mixing (attention, or a SwiGLU across positions) then a SwiGLU
    (URM's ConvSwiGLU with conv_kernel)."""

    def __init__(self, config: TRMConfig):
        super().__init__()
        self.eps = config.rms_norm_eps
        if config.mlp_t:
            self.seq_mlp = SwiGLU(config.total_len, config.expansion)
        else:
            self.attn = Attention(config.hidden_size, config.num_heads, config.attention, config.attention_block,
                                  rope2d=config.pos_encodings == "rope2d")
        self.mlp = (ConvSwiGLU(config.hidden_size, config.expansion, config.conv_kernel) if config.conv_kernel
                    else SwiGLU(config.hidden_size, config.expansion))

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        if hasattr(self, "seq_mlp"):
            # Mixing across positions; the norm is taken over positions too, as in the reference
            # (which transposes to [batch, channels, positions] and back around both).
            x = rms_norm(x + self.seq_mlp.across_positions(x), self.eps, dim=1)
        else:
            x = rms_norm(x + self.attn(x, rope), self.eps)
        return rms_norm(x + self.mlp(x), self.eps)


class SparseEmbedding(nn.Module):
    """The puzzle-embedding table: a float32 buffer trained by SignSGD, not by autograd.

    In training, the rows of the batch are gathered into a fresh leaf tensor that receives the
    gradient; `SignSGD` then reads `batch_rows.grad` and `batch_ids`. The table itself never
    gets a dense gradient, so a 900k-row ARC table costs nothing per step beyond its rows.
    """

    def __init__(self, num_rows: int, width: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(num_rows, width))  # the reference inits to 0
        self.batch_rows: torch.Tensor | None = None
        self.batch_ids: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, ids)
        if self.training and torch.is_grad_enabled():
            rows = rows.detach().requires_grad_(True)
            self.batch_rows, self.batch_ids = rows, ids
        return rows


# ----------------------------------------------------------------------------------------------
# The recursive model with its ACT carry


@dataclass
class Carry:
    """State that persists across training steps, one row per batch slot."""

    z_H: torch.Tensor  # [B, total_len, hidden] forward_dtype
    z_L: torch.Tensor  # [B, total_len, hidden] forward_dtype
    steps: torch.Tensor  # [B] int32, ACT steps taken by the row's current example
    halted: torch.Tensor  # [B] bool, the row takes a new example at the next step
    current_data: dict[str, torch.Tensor]  # the example each row is working on
    rng_counter: torch.Tensor  # [] int64, ACT steps taken by the whole carry (exploration key)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name → tensor view (for checkpoints and sharding)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "current_data"}
        out.update({f"current_data.{k}": v for k, v in self.current_data.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Carry:
        data = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("current_data.")}
        return cls(current_data=data, **{k: v for k, v in tensors.items() if "." not in k})


class TRM(nn.Module):
    """TRM with the ACT wrapper: `forward(carry, batch)` runs one ACT step (segment)."""

    def __init__(self, config: TRMConfig, exploration_seed: int = 0):
        super().__init__()
        problems = config.problems()
        if problems:
            raise ValueError("TRMConfig: " + "; ".join(problems))
        self.config = config
        self.exploration_seed = exploration_seed
        self.embed_scale = math.sqrt(config.hidden_size)
        self.token_embedding = nn.Parameter(
            truncated_normal_(torch.empty(config.vocab_size, config.hidden_size), std=1 / self.embed_scale))
        if config.pos_encodings == "learned":
            self.position_embedding = nn.Parameter(
                truncated_normal_(torch.empty(config.total_len, config.hidden_size), std=1 / self.embed_scale))
        if config.pos_encodings in ("rope", "rope2d"):
            tables = rope_tables if config.pos_encodings == "rope" else rope2d_tables
            cos, sin = tables(config.hidden_size // config.num_heads, config.total_len, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if config.puzzle_emb_ndim > 0:
            self.puzzle_embedding = SparseEmbedding(config.num_puzzle_identifiers, config.puzzle_emb_ndim)
        networks = config.scheme.networks(config)
        if "L" in networks:
            self.blocks = nn.ModuleList([Block(config) for _ in range(networks["L"])])
        if "H" in networks:
            self.H_blocks = nn.ModuleList([Block(config) for _ in range(networks["H"])])
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.q_head = Linear(config.hidden_size, 2, bias=True)
        with torch.no_grad():  # Q head starts near "never halt" (sigmoid(-5) ≈ 0.007)
            self.q_head.weight.zero_()
            self.q_head.bias.fill_(-5.0)
        for name in config.scheme.inits:  # the initial states, under the reference's names
            self.register_buffer(name, truncated_normal_(torch.empty(config.hidden_size, dtype=config.dtype), std=1.0))

    # -- the network --------------------------------------------------------------------------

    def embed(self, inputs: torch.Tensor, puzzle_identifiers: torch.Tensor) -> torch.Tensor:
        config = self.config
        # Looked up in float32, then cast: the same values as a lookup in the cast table, and the
        # table's gradient is summed over tokens (and devices) in float32, as the reference's is.
        x = F.embedding(inputs.to(torch.int32), self.token_embedding).to(config.dtype)
        if config.puzzle_emb_ndim > 0:
            rows = self.puzzle_embedding(puzzle_identifiers).to(config.dtype)
            rows = F.pad(rows, (0, config.prefix_len * config.hidden_size - config.puzzle_emb_ndim))
            x = torch.cat([rows.view(-1, config.prefix_len, config.hidden_size), x], dim=1)
        elif config.prefix_len:
            x = F.pad(x, (0, 0, config.prefix_len, 0))
        if config.pos_encodings == "learned":
            x = 0.707106781 * (x + self.position_embedding.to(config.dtype))  # keeps the variance
        return self.embed_scale * x

    def net(self, z: torch.Tensor, injection: torch.Tensor | None, level: str = "L") -> torch.Tensor:
        """A network (L: `blocks`, the shared one; H: `H_blocks`): z + injection through its blocks."""
        rope = (self.rope_cos, self.rope_sin) if self.config.pos_encodings in ("rope", "rope2d") else None
        z = z if injection is None else z + injection
        for block in self.blocks if level == "L" else self.H_blocks:
            z = block(z, rope)
        return z

    def recurse(self, z_H, z_L, x, keys: torch.Tensor | None = None):
        """One ACT step of the arch's recursion (modeling/schemes.py), then the heads. `keys`: the
        step's per-row draw keys (int32 [B]) of a scheme that draws (RecursionScheme.draws)."""
        z_H, z_L, out = self.config.scheme.recurse(self, z_H, z_L, x, keys)
        logits = self.lm_head(out)[:, self.config.prefix_len:]
        q = self.q_head(out[:, 0]).float()
        return z_H, z_L, logits, q[..., 0], q[..., 1]

    # -- ACT ----------------------------------------------------------------------------------

    def initial_carry(self, batch: dict[str, torch.Tensor]) -> Carry:
        """A carry whose rows are all halted, so the first step loads the whole batch."""
        config = self.config
        size, device = batch["inputs"].shape[0], batch["inputs"].device
        h_shape, l_shape = config.scheme.state_shapes(config)
        return Carry(
            z_H=torch.zeros((size, *h_shape), dtype=config.dtype, device=device),
            z_L=torch.zeros((size, *l_shape), dtype=config.dtype, device=device),
            steps=torch.zeros(size, dtype=torch.int32, device=device),
            halted=torch.ones(size, dtype=torch.bool, device=device),
            current_data={k: torch.zeros_like(v) for k, v in batch.items()},
            rng_counter=torch.zeros((), dtype=torch.int64, device=device),
        )

    def forward(self, carry: Carry, batch: dict[str, torch.Tensor],
                perturb=None) -> tuple[Carry, dict[str, torch.Tensor]]:
        """One ACT step. `perturb(z_H, z_L, data, steps)`, if given, returns the latents this step's
        recursion starts from (test-time noise, noisy_trajectories.py; `steps` counts the row's earlier steps)."""
        config = self.config
        # Rows that halted at the previous step start over on the new batch's example.
        reset = carry.halted
        per_row = lambda t: reset.view((-1,) + (1,) * (t.ndim - 1))
        steps = torch.where(reset, 0, carry.steps)
        scheme, keys = config.scheme, None
        if scheme.draws:
            # A scheme that draws random numbers (EqR) gets per-row keys of (seed, the carry's
            # rng_counter, row) in training; in evaluation (row, the row's earlier ACT steps), so
            # that an evaluation's draws do not depend on the evaluations before it.
            rows = torch.arange(steps.shape[0], device=steps.device)
            counter = carry.rng_counter if self.training else steps
            keys = hashed_keys(self.exploration_seed, counter, rows, DRAWS_STREAM)
            h_init, l_init = scheme.initial_states(self, keys, carry)
        else:
            h_init, l_init = scheme.initial_states(self)
        z_H = torch.where(per_row(carry.z_H), h_init, carry.z_H)
        z_L = torch.where(per_row(carry.z_L), l_init, carry.z_L)
        data = {k: torch.where(per_row(v), batch[k], v) for k, v in carry.current_data.items()}
        if perturb is not None:
            z_H, z_L = perturb(z_H, z_L, data, steps)

        x = self.embed(data["inputs"], data["puzzle_identifiers"])
        z_H, z_L, logits, q_halt, q_continue = self.recurse(z_H, z_L, x, keys)
        outputs = {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": q_continue}

        with torch.no_grad():
            steps = steps + 1
            halted = steps >= config.halt_max_steps
            if self.training and config.halt_max_steps > 1 and config.act_enabled:
                halted = halted | (config.halt_score(q_halt, q_continue) > 0)
                # Exploration: some rows must run a random minimum of 2..halt_max_steps steps.
                rows = torch.arange(steps.shape[0], device=steps.device)
                seed, counter = self.exploration_seed, carry.rng_counter
                explore = hashed_uniform(seed, counter, rows, 0) < exploration_prob(config, counter)
                draw = hashed_uniform(seed, counter, rows, 1)
                min_steps = 2 + (draw * (config.halt_max_steps - 1)).to(torch.int32)
                halted = halted & (steps >= torch.where(explore, min_steps, 0))
                if config.scheme.q_continue_target(config):
                    # The reference's bootstrapped target: Q of the next step from the new state.
                    _, _, _, next_halt, next_continue = self.recurse(z_H, z_L, x)
                    is_last = steps >= config.halt_max_steps
                    outputs["target_q_continue"] = torch.sigmoid(
                        torch.where(is_last, next_halt, torch.maximum(next_halt, next_continue)))

        new_carry = Carry(z_H=z_H.detach(), z_L=z_L.detach(), steps=steps, halted=halted,
                          current_data=data, rng_counter=carry.rng_counter + 1)
        return new_carry, outputs


# ----------------------------------------------------------------------------------------------
# Loss


def stablemax_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log of stablemax: s(x) = 1/(1-x) for x < 0, x + 1 otherwise, normalised over the last dim.

    The reference evaluates both branches of its `where` on every logit, in float64. In float32
    the unused branch 1/(1-x) overflows its derivative at x = 1 (which bf16 logits hit often),
    and the where's zero gradient times inf is NaN. So each branch gets only the logits it is
    used for (clamped), log s is computed directly (log1p), and the normaliser is a logsumexp of
    log s: finite values and gradients for every finite logit, equal to log(s / sum s).
    """
    x = logits.float()
    log_s = torch.where(x < 0, -torch.log1p(-x.clamp(max=0.0)), torch.log1p(x.clamp(min=0.0)))
    return log_s - torch.logsumexp(log_s, dim=-1, keepdim=True)


def stablemax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss [..., seq]; 0 where labels == IGNORE_LABEL_ID."""
    valid = labels != IGNORE_LABEL_ID
    safe_labels = torch.where(valid, labels, 0).to(torch.int64)
    # The label's log-probability picked by a mask rather than `gather`: the same value (one
    # term, the rest exact zeros), but its backward is elementwise; gather's is a scatter, which
    # XLA's SPMD partitioner does not see as row-local and all-gathers across every device
    # (indices and gradients of the whole global batch, compiled for a TPU: tpu_compile.py).
    log_probs = stablemax_log_probs(logits)
    vocab = torch.arange(log_probs.shape[-1], device=log_probs.device)
    picked = torch.where(vocab == safe_labels.unsqueeze(-1), log_probs, 0.0).sum(-1)
    return torch.where(valid, -picked, 0.0)


def loss_and_metrics(carry: Carry, outputs: dict[str, torch.Tensor],
                     halted_losses: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference's ACT loss (sum over the batch) and its metrics summed over halted rows.

    Divide the loss by the global batch size before backward. Metrics are float32 device
    tensors; divide lm_loss/q_halt_loss by the batch size and the others by `count` to report.
    halted_losses: the lm_loss/q_halt_loss metrics sum only the rows `count` counts (halted,
    with labels), like the other metrics; for evaluation, where rows halt at the last ACT step
    only (the reference sums each batch's last step) and padding rows must not count.
    """
    labels = carry.current_data["labels"]
    logits = outputs["logits"]
    valid = labels != IGNORE_LABEL_ID
    valid_count = valid.sum(-1)
    divisor = valid_count.clamp_min(1).unsqueeze(-1)

    with torch.no_grad():
        correct = valid & (logits.argmax(-1) == labels)
        seq_correct = correct.sum(-1) == valid_count
        counted = carry.halted & (valid_count > 0)
        q_halt = outputs["q_halt_logits"]
        metrics = {
            "count": counted.sum(),
            "accuracy": torch.where(counted, (correct.float() / divisor).sum(-1), 0.0).sum(),
            "exact_accuracy": (counted & seq_correct).sum(),
            "q_halt_accuracy": (counted & ((q_halt >= 0) == seq_correct)).sum(),
            "steps": torch.where(counted, carry.steps, 0).sum(),
        }

    token_losses = stablemax_cross_entropy(logits, labels) / divisor
    lm_loss = token_losses.sum()
    q_halt_loss = F.binary_cross_entropy_with_logits(q_halt, seq_correct.float(), reduction="sum")
    loss = lm_loss + 0.5 * q_halt_loss
    metrics["lm_loss"] = lm_loss.detach()
    metrics["q_halt_loss"] = q_halt_loss.detach()
    if halted_losses:
        with torch.no_grad():
            q_losses = F.binary_cross_entropy_with_logits(q_halt, seq_correct.float(), reduction="none")
            metrics["lm_loss"] = torch.where(counted, token_losses.sum(-1), 0.0).sum()
            metrics["q_halt_loss"] = torch.where(counted, q_losses, 0.0).sum()
    if "target_q_continue" in outputs:
        q_continue_loss = F.binary_cross_entropy_with_logits(
            outputs["q_continue_logits"], outputs["target_q_continue"], reduction="sum")
        loss = loss + 0.5 * q_continue_loss
        metrics["q_continue_loss"] = q_continue_loss.detach()
    return loss, {k: v.float() for k, v in metrics.items()}
