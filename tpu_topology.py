"""The TPU slices the compiler targets: each generation's chip as the compiler sees it (Google's
published HBM, bandwidth, bf16 peak and clock per device) and each slice's compile-only topology
(libtpu's topology name, devices, chips per host), for tpu_compile.py."""
from __future__ import annotations

from dataclasses import dataclass

from projection import slice_spec


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
