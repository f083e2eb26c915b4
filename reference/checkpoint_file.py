"""A checkpoint file written by an arch's own code, read as data: the reference's `step_N` (its
model's state dict, `save_train_state`), EqR's `step_N.pth` (its utils/checkpoint.py
`save_checkpoint`: the state dict under "model", the EMA's average under "ema" = {"mu", "shadow"},
its PretrainConfig under "config", besides the optimizers, the carry and the random generators'
states) and URM's `step_N.pt` (its pretrain.py `save_train_state`: the state dict, the EMA copy's
when it trains one, under "model_state_dict"; "step"; the optimizers' states).

torch.load's weights_only unpickler reads them without running anything from the file. EqR's
files also pickle objects of its own classes (the carry) and numpy's generator state, which
that unpickler refuses: each such class or function the file names is read as an inert
stand-in (`Unread`) instead of being imported, so nothing in the file runs and the tensors are
read as saved."""
from __future__ import annotations

import dataclasses
import io

import torch

from rundir import storage


class Unread:
    """What a checkpoint holds of a class or function this project does not import (EqR's carry,
    numpy's arrays): an object that takes any arguments and state and keeps none of them."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def load_as_data(data: bytes):
    """torch.load of a file's bytes with the weights_only unpickler, every global that unpickler
    does not allow read as `Unread`."""
    unknown = []
    try:
        unknown = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except ValueError:  # not a zip file (torch's legacy format): weights_only alone
        pass
    with torch.serialization.safe_globals([(Unread, name) for name in unknown]):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


@dataclasses.dataclass
class CheckpointFile:
    weights: dict[str, torch.Tensor]
    """The model's tensors under its code's names (`model.inner.*`; `_orig_mod.` removed from
    EqR's, which its loaders strip too): the EMA's average where the code evaluates it."""
    config: dict | None
    """The run's configuration saved in the file (EqR's "config", its PretrainConfig), or None."""
    step: int | None
    layout: str
    """"state_dict" (the reference's, or any file of the state dict alone), "eqr" or "urm"."""


def checkpoint_contents(saved) -> CheckpointFile:
    """The weights, config and step of a loaded checkpoint object, by its layout. EqR's: "model"
    with the "ema" shadow's tensors in place of the parameters it averages, as EqR's evaluate.py
    evaluates (when its config's `ema` is on, every EqR recipe; a file without a config is taken
    to be one of them)."""
    if isinstance(saved, dict) and isinstance(saved.get("model_state_dict"), dict):
        return CheckpointFile(dict(saved["model_state_dict"]), None, saved.get("step"), "urm")
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        config = saved.get("config") if isinstance(saved.get("config"), dict) else None
        weights = {k.replace("_orig_mod.", ""): v for k, v in saved["model"].items()}
        ema = saved.get("ema")
        if isinstance(ema, dict) and (config is None or config.get("ema")):
            shadow = ema.get("shadow") if isinstance(ema.get("shadow"), dict) else ema
            weights.update({k.replace("_orig_mod.", ""): v for k, v in shadow.items() if isinstance(v, torch.Tensor)})
        return CheckpointFile(weights, config, saved.get("step"), "eqr")
    if isinstance(saved, dict) and saved and all(isinstance(v, torch.Tensor) for v in saved.values()):
        return CheckpointFile(dict(saved), None, None, "state_dict")
    raise ValueError("not a checkpoint of the reference's, EqR's or URM's code: neither a state dict nor a dict "
                     "with one under model / model_state_dict"
                     + (f" (its keys: {sorted(map(str, saved))[:12]})" if isinstance(saved, dict) else ""))


def read_checkpoint_file(url: str) -> CheckpointFile:
    """The weights, config and step of the checkpoint file at `url` (local or gs://)."""
    return checkpoint_contents(load_as_data(storage.read_bytes(url)))
