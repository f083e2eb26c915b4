"""The project's one counter-based hash: random numbers as a pure function of their key (seed,
step, row, element, ...) instead of draws from a stateful generator, so they are identical on CPU
and XLA, sharded or not, at any batch layout, and after a resume. The training's halting
exploration (`hashed_uniform`) and test-time scaling's noise (`hashed_normal`, testtime/noisy_trajectories.py) use it.

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


def hashed_uniform(seed: int, counter: torch.Tensor, rows: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform [0, 1) float32 of (seed, counter, row, stream): the halting exploration's draws."""
    key = int32(seed * 0x27D4EB2F + stream * 0x165667B1)
    x = rows.to(torch.int32) * int32(0x9E3779B1) + counter.to(torch.int32) * int32(0x85EBCA77) + key
    return unit(mix(x))


def hashed_normal(keys: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 [rows, *shape]: element i of row r is a pure function of the int32
    (keys[r], i), by Box-Muller on two 24-bit uniforms hashed from them."""
    count = math.prod(shape)
    elements = torch.arange(0, 2 * count, 2, device=keys.device, dtype=torch.int32).view(1, *shape)
    base = mix(keys).view(-1, *([1] * len(shape))) * int32(0x632BE5AB) + elements
    u1 = (shift_right(mix(base), 8) + 1).to(torch.float32) * (1.0 / (1 << 24))  # (0, 1]
    u2 = unit(mix(base + 1))  # [0, 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)
