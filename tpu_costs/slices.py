"""The slice table, in one place: each TPU generation's chip (Google's published HBM, bandwidth,
bf16 peak and clock per device: assumed, not measured), the runtime's device kinds, each slice's
chips and hosts from its name, and its compile-only topology (libtpu's topology name, devices,
chips per host) for tpu_compile.py. The step line's MFU, the cost model and the compiler's
estimates all read their figures here."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One TPU generation as the compiler sees it, with Google's published figures per device
    (a v4 or v5p chip is one megacore device)."""

    hbm_bytes: int
    hbm_gb_per_s: float
    peak_tflops: float  # bf16 dense
    clock_ghz: float  # TensorCore clock: turns XLA's cycle estimates into time
    chip_config: str  # libtpu's chip configuration: "megacore" gives one device per chip


CHIPS = {  # cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}; the clocks from the v4 paper and Google's specs pages
    "v4": Chip(32 << 30, 1228.0, 275.0, 1.05, "megacore"),
    "v5e": Chip(16 << 30, 819.0, 197.0, 1.5, "default"),
    "v5p": Chip(95 << 30, 2765.0, 459.0, 1.75, "megacore"),
    "v6e": Chip(32 << 30, 1640.0, 918.0, 1.75, "default"),
}
PEAK_TFLOPS_PER_CHIP = {generation: chip.peak_tflops for generation, chip in CHIPS.items()}  # bf16 dense
"""Peak bf16 TFLOP/s of one chip per TPU generation (v5p: docs.cloud.google.com/tpu/docs/v5p-training).
A chip is one PyTorch/XLA device on each of them (the two TensorCores of a v4 or v5p chip are one
megacore device), so this is also the peak per device."""

# The runtime's device kind (PJRT's name, e.g. "TPU v4"; v5e calls itself "TPU v5 lite", v5p
# "TPU v5", v6e "TPU v6 lite") -> the generation of PEAK_TFLOPS_PER_CHIP.
_KIND_GENERATIONS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5litepod": "v5e",
                     "tpu v5": "v5p", "tpu v5p": "v5p", "tpu v6 lite": "v6e", "tpu v6e": "v6e"}


def peak_tflops_per_device(device_kind: str | None) -> float | None:
    """bf16 peak TFLOP/s of one device of this kind ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6
    lite"), or None for any other kind (CPU, an unknown TPU): no peak, so no MFU."""
    generation = _KIND_GENERATIONS.get((device_kind or "").strip().lower())
    return PEAK_TFLOPS_PER_CHIP[generation] if generation else None


@dataclass(frozen=True)
class SliceSpec:
    name: str
    generation: str
    chips: int
    hosts: int
    peak_tflops_per_chip: float

    @property
    def peak_tflops(self) -> float:
        return self.chips * self.peak_tflops_per_chip


def slice_spec(name: str) -> SliceSpec:
    """Chips and hosts of a slice from its name, as Cloud TPU names them.

    v4-N and v5p-N count TensorCores (2 per chip): N/2 chips, 4 chips per host (v4-8: 1 host,
    v4-64: 32 chips on 8 hosts). v5e-N and v6e-N count chips: a slice of up to 8 chips is one
    host, larger ones have 4 chips per host. Peak per chip (bf16): v4 275, v5e 197, v5p 459, v6e
    918 TFLOP/s.
    """
    match = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", name.strip().lower())
    if not match:
        raise ValueError(f"unknown TPU slice {name!r}: use v4-N, v5e-N, v5p-N or v6e-N (e.g. v4-64, v5e-16, v6e-8)")
    generation, n = match.group(1), int(match.group(2))
    if generation in ("v4", "v5p"):
        if n < 8 or n % 8:
            raise ValueError(f"{name}: a {generation} slice counts TensorCores, a multiple of 8 "
                             f"({generation}-8, {generation}-16, ...)")
        chips = n // 2
        hosts = chips // 4
    else:
        if n < 1:
            raise ValueError(f"{name}: a slice has at least one chip")
        chips = n
        hosts = 1 if n <= 8 else -(-n // 4)
    return SliceSpec(name.strip().lower(), generation, chips, hosts, PEAK_TFLOPS_PER_CHIP[generation])


# Chips of a slice -> libtpu's topology name (3-D torus for v4/v5p, 2-D for v5e/v6e).
_TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
_TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclass(frozen=True)
class Topology:
    slice: str
    generation: str
    name: str  # e.g. v4:2x4x4
    devices: int
    chips_per_host: tuple[int, int, int]
    chip: Chip


def topology(slice_name: str) -> Topology:
    """The compile-only topology of a slice (v4-8, v4-64, v5e-8, v6e-64, v5p-8, ...)."""
    spec = slice_spec(slice_name)
    shapes = _TORUS_3D if spec.generation in ("v4", "v5p") else _TORUS_2D
    if spec.chips not in shapes:
        raise ValueError(f"{spec.name}: no known {spec.generation} topology of {spec.chips} chips; "
                         f"use one of {', '.join(str(c) for c in shapes)} chips")
    per_host = {1: (1, 1, 1), 8: (2, 4, 1)}.get(spec.chips, (2, 2, 1)) if spec.generation in ("v5e", "v6e") \
        else (2, 2, 1)
    return Topology(spec.name, spec.generation, f"{spec.generation}:{shapes[spec.chips]}", spec.chips, per_host,
                    CHIPS[spec.generation])
