"""What a test-time evaluation read, saved in its setting's metrics.json beside the scores: the
weights (a fingerprint of their contents), the test split (a fingerprint of its contents), the
examples read and the setting. `train.py eval` reuses a setting's metrics only when every part of
its identity is the same; a result of other weights, other data, another subset or another
setting is evaluated again and replaced (commands/eval_command.py).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

import data

KEYS = ("weights", "data", "max_examples", "seed", "arc_aggregate", "trajectories", "noise", "act_steps",
        "noise_latent")
"""The parts of an evaluation's identity in its metrics.json: the weights' and the test split's
fingerprints, the subset asked for (None: every example) and the seed that draws it and the
noise, whether ARC votes aggregate over the run's evaluations, and the setting (K, noise, D,
latent). The step and the data path are saved too, to be read, but a copy of the same weights
or of the same dataset elsewhere is the same evaluation."""


def _digest(parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, (bytes, memoryview)) else str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """16 hex digits of sha256 over each tensor's name, dtype, shape and bytes, in name order: the
    weights evaluated, computed on the host from the state dict loaded (`model/*` names or not:
    the same tensors give the same fingerprint either way)."""
    def parts():
        for name in sorted(weights, key=lambda n: n.removeprefix("model/")):
            tensor = weights[name].detach().to("cpu").contiguous()
            yield name.removeprefix("model/")
            yield f"{tensor.dtype} {tuple(tensor.shape)}"
            yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    return _digest(parts())


def _array_parts(name: str, array: np.ndarray, rows: int = 1 << 16):
    yield f"{name} {array.dtype.str} {array.shape}"
    array = np.ascontiguousarray(array) if array.ndim < 2 else array
    for start in range(0, max(len(array), 1), rows):  # a memory-mapped array in chunks of rows
        yield memoryview(np.ascontiguousarray(array[start:start + rows])).cast("B")


def data_fingerprint(test_set: data.Dataset, identifiers: str | None, also: bytes = b"") -> str:
    """16 hex digits of sha256 over the test split as read: its dataset.json, the fingerprint of
    the dataset's identifiers, every array's dtype, shape and values, and `also` (ARC's
    test_puzzles.json, which scores the answers). A copy at another path is the same data; a
    rebuilt split with other puzzles is not."""
    def parts():
        yield json.dumps(test_set.metadata.to_dict(), sort_keys=True)
        yield str(identifiers)
        for name in ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices"):
            yield from _array_parts(name, getattr(test_set, name))
        yield also
    return _digest(parts())


def differences(saved: dict | None, identity: dict) -> list[str]:
    """What differs between a saved setting's metrics and this evaluation's identity, as
    'KEY: SAVED, now NEW' (every key when nothing is saved)."""
    if saved is None:
        return ["not evaluated"]
    return [f"{k}: {saved.get(k, 'not recorded')!r}, now {v!r}" for k, v in identity.items() if saved.get(k) != v]
