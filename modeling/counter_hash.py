"""The project's one counter-based hash: random numbers as a pure function of their key (seed,
step, row, element, ...) instead of draws from a stateful generator, so they are identical on CPU
and XLA, sharded or not, at any batch layout, and after a resume. The training's halting
exploration (`hashed_uniform`), test-time scaling's noise (`hashed_normal`, testtime/noisy_trajectories.py)
and EqR's fresh initial states and noisy updates (`hashed_keys`, `hashed_normal`,
`hashed_truncated_normal`; modeling/schemes.py's EqR) use it.

All arithmetic is int32, whose products and sums wrap modulo 2**32 on CPU and XLA alike (a TPU
emulates int64): `mix` is three xorshift-multiply rounds of a 32-bit pattern (the low-bias
"triple32" constants), with logical right shifts.
"""
from __future__ import annotations

import math

import torch

MULTIPLIERS = (0x7FEB352D, 0x4C8E9CF5, 0x2C1B3C6D)
"""The three rounds' multipliers."""


def int32(value: int) -> int:
    """The int32 of the low 32 bits of a Python int (a pattern above 2**31 as its negative twin)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int32 bit patterns. Shifted only while non-negative: torch_xla
    rounds `>>` of a negative int32 toward zero, as a division (-5 >> 16 is 0 there, -1 on CPU)."""
    return ((x & 0x7FFFFFFF) >> bits) | torch.where(x < 0, 1 << (31 - bits), 0).to(torch.int32)


def mix(x: torch.Tensor) -> torch.Tensor:
    """int32: a 32-bit avalanche of the int32 bit patterns `x`."""
    x = x.to(torch.int32)
    for multiplier in MULTIPLIERS:
        x = (x ^ shift_right(x, 16)) * int32(multiplier)
    return x ^ shift_right(x, 16)


def unit(x: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1): the top 24 bits of the int32 patterns `x` (already mixed)."""
    return shift_right(x, 8).to(torch.float32) * (1.0 / (1 << 24))


def hashed_keys(seed: int, counter: torch.Tensor, rows: torch.Tensor, stream: int) -> torch.Tensor:
    """int32 [rows]: the mixed key of (seed, counter, row, stream); `counter` a scalar or one per row."""
    key = int32(seed * 0x27D4EB2F + stream * 0x165667B1)
    return mix(rows.to(torch.int32) * int32(0x9E3779B1) + counter.to(torch.int32) * int32(0x85EBCA77) + key)


def hashed_uniform(seed: int, counter: torch.Tensor, rows: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform [0, 1) float32 of (seed, counter, row, stream): the halting exploration's draws."""
    return unit(hashed_keys(seed, counter, rows, stream))


def _element_bases(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """int32 [rows, *shape]: the pattern of element i of row r, mix(keys[r]) * odd + 2i (2i + 1 is
    the element's second pattern)."""
    count = math.prod(shape)
    elements = torch.arange(0, 2 * count, 2, device=keys.device, dtype=torch.int32).view(1, *shape)
    return mix(keys).view(-1, *([1] * len(shape))) * int32(0x632BE5AB) + elements


def hashed_normal(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 [rows, *shape]: element i of row r is a pure function of the int32
    (keys[r], i), by Box-Muller on two 24-bit uniforms hashed from them."""
    base = _element_bases(keys, shape)
    u1 = (shift_right(mix(base), 8) + 1).to(torch.float32) * (1.0 / (1 << 24))  # (0, 1]
    u2 = unit(mix(base + 1))  # [0, 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)


TRUNCATION = 2.0
"""The truncated normal's bound in standard deviations of the untruncated normal (JAX's, the reference's)."""


def hashed_truncated_normal(keys: torch.Tensor, shape: tuple[int, ...], std: float = 1.0) -> torch.Tensor:
    """float32 [rows, *shape]: JAX-style truncated normal on [-2, 2] standard deviations whose actual
    std is `std` (model.truncated_normal_'s distribution, the reference's trunc_normal_init_'s),
    element i of row r a pure function of (keys[r], i): erfinv of a 24-bit uniform hashed from them
    in [erf(-2/sqrt 2), erf(2/sqrt 2)), as the reference maps torch's uniform_."""
    lo, hi = math.erf(-TRUNCATION / math.sqrt(2)), math.erf(TRUNCATION / math.sqrt(2))
    pdf = math.exp(-0.5 * TRUNCATION ** 2) / math.sqrt(2 * math.pi)
    variance = 1 - 2 * TRUNCATION * pdf / hi  # of the truncated standard normal (mass hi)
    scale = std / math.sqrt(variance)
    u = unit(mix(_element_bases(keys, shape)))
    z = torch.erfinv(lo + (hi - lo) * u) * (math.sqrt(2) * scale)
    return z.clamp(-TRUNCATION * scale, TRUNCATION * scale)
