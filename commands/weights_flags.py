"""The command line of the commands that run given weights (`train.py eval` and `predict`): the
weights (--init-from), then any setting of the training configuration, applied on top of the
weights' own run configuration rather than of the preset.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated

import tyro

from training.config import PRESETS, Config, presets_for


@dataclass
class WeightsCommand:
    """The flags of a command that runs given weights (eval): the weights, then any setting
    of the training configuration (they override what the weights' run used)."""

    init_from: Annotated[str, tyro.conf.arg(help_behavior_hint="(required)")]
    """The weights: a run directory (its newest readable checkpoint), a checkpoint directory, an exported model.safetensors or model directory, or a checkpoint of the reference's, EqR's or URM's own code; local or gs://."""  # noqa: E501 (one line: tyro keeps line breaks)
    config: Annotated[Config, tyro.conf.arg(name="")] = field(default_factory=Config)


def parse_weights_command(command: str, argv: list[str], description: str,
                          flags: type[WeightsCommand] = WeightsCommand) -> tuple[str, WeightsCommand, list[str]]:
    """(preset, the command's own flags parsed, the configuration flags as typed) of
    `train.py COMMAND [PRESET] ...`; tyro checks every flag and prints `--help` (exit 0). The
    configuration flags are returned unparsed: they apply on top of the weights' own run
    configuration, not of the preset."""
    preset = argv[0] if argv and argv[0] in PRESETS else "sudoku-mlp"
    rest = argv[1:] if argv and argv[0] in PRESETS else argv
    parsed = tyro.cli(flags, args=rest, default=flags("", presets_for(rest)[preset][1]),
                      prog=f"train.py {command} [PRESET]", description=description)
    if not parsed.init_from:
        raise SystemExit(f"error: {command} needs --init-from URL (a run directory, checkpoint, exported "
                         "model.safetensors, or a checkpoint of the reference's, EqR's or URM's code)")
    own = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(flags) if f.name != "config"}
    overrides, skip = [], False
    for arg in rest:  # every flag but the command's own (`--flag value` or `--flag=value`)
        name = arg.split("=", 1)[0].replace("_", "-")
        if skip:
            skip = False
        elif name in own:
            skip = "=" not in arg
        else:
            overrides.append(arg)
    return preset, parsed, overrides
