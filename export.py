"""`train.py export`: a run's EMA weights as one model.safetensors file, its config in the
file's metadata.

    python train.py export gs://BUCKET/runs/NAME --out gs://BUCKET/models/NAME.safetensors
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import tyro

import checkpoint
import storage


@dataclass
class ExportCommand:
    """Write the EMA weights of a checkpoint as one model.safetensors (config in its metadata)."""

    source: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="SOURCE")]
    """A run directory (its newest readable committed checkpoint) or one checkpoint directory."""
    out: str
    """Where to write, local or gs:// (e.g. gs://BUCKET/models/sudoku.safetensors)."""


def export_command(argv: list[str]) -> None:
    """`python train.py export SOURCE --out URL`."""
    flags = tyro.cli(ExportCommand, args=argv, prog="train.py export")
    export(flags.source, flags.out)


def export(source: str, out: str) -> None:
    """Write the EMA weights of `source` (ExportCommand) to `out`."""
    for what, value in (("the export source", source), ("--out", out)):
        try:
            storage.check_url(value, what)
        except storage.StorageError as e:
            raise SystemExit(f"error: {e}")
    try:
        found = checkpoint.weights_of(source)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    if found is None:
        raise SystemExit(f"error: {source} is not a run or checkpoint directory")
    weights, state, url = found
    checkpoint.export_model(weights, state, out)
    print(f"exported the EMA weights of {url} (step {state['step']}) to {out}", flush=True)
