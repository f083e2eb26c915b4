"""`train.py export`: a run's EMA weights as one model.safetensors file, its config in the
file's metadata; with `--format reference`, `eqr` or `urm`, a model directory that the arch's own
code runs too: the TRM reference's (reference/model_dir.py), EqR's or URM's
(reference/successors.py).

    python train.py export gs://BUCKET/runs/NAME --out gs://BUCKET/models/NAME.safetensors
    python train.py export gs://BUCKET/runs/NAME --format reference --out gs://BUCKET/models/NAME
    python train.py export gs://BUCKET/runs/EQR_RUN --format eqr --out gs://BUCKET/models/EQR_RUN
    python train.py export gs://BUCKET/runs/URM_RUN --format urm --out gs://BUCKET/models/URM_RUN
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from rundir import storage
from training import checkpoint


@dataclass
class ExportCommand:
    """Write the EMA weights of a checkpoint as one model.safetensors (config in its metadata)."""

    source: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="SOURCE")]
    """A run directory (its newest readable committed checkpoint) or one checkpoint directory."""
    out: str
    """Where to write, local or gs:// (gs://BUCKET/models/sudoku.safetensors; a directory with the other formats)."""
    format: Literal["ours", "reference", "eqr", "urm"] = "ours"
    """ours: one model.safetensors; reference, eqr, urm: a model directory that the TRM reference's, EqR's (arch eqr) or URM's (arch urm) own code runs too."""  # noqa: E501 (one line: tyro keeps line breaks)


def export_command(argv: list[str]) -> None:
    """`python train.py export SOURCE --out URL [--format reference|eqr|urm]`."""
    flags = tyro.cli(ExportCommand, args=argv, prog="train.py export")
    check_urls(flags.source, flags.out)
    if flags.format != "ours":
        from reference.model_dir import export_directory
        from reference.successors import TARGETS

        export_directory(flags.source, flags.out, TARGETS[flags.format])
    else:
        export(flags.source, flags.out)


def check_urls(source: str, out: str) -> None:
    """Both URLs of an export well formed, or SystemExit with the one-line error that says why."""
    for what, value in (("the export source", source), ("--out", out)):
        try:
            storage.check_url(value, what)
        except storage.StorageError as e:
            raise SystemExit(f"error: {e}")


def export(source: str, out: str) -> None:
    """Write the EMA weights of `source` (ExportCommand) to `out`."""
    check_urls(source, out)
    try:
        found = checkpoint.weights_of(source)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    if found is None:
        raise SystemExit(f"error: {source} is not a run or checkpoint directory")
    weights, state, url = found
    checkpoint.export_model(weights, state, out)
    print(f"exported the EMA weights of {url} (step {state['step']}) to {out}", flush=True)
