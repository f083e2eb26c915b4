"""The only file that speaks torch_xla SPMD: the device mesh and tensor sharding annotations.

Data parallel over one global 1-D mesh named "data": batch-shaped tensors (inputs, the ACT
carry) are split on their first dimension across every device of every host; parameters and
optimizer state are replicated.
"""
from __future__ import annotations

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

_spmd_on = False


def init_spmd() -> None:
    """Switch the process to SPMD mode (once, before any XLA tensor exists)."""
    global _spmd_on
    if not _spmd_on:
        xr.use_spmd()
        _spmd_on = True


def data_mesh() -> xs.Mesh:
    """One axis over all devices of the slice; the size always comes from the runtime."""
    num_devices = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(num_devices), (num_devices,), ("data",))


def device() -> torch.device:
    return torch_xla.device()


def shard_batch_dim(tensor: torch.Tensor, mesh: xs.Mesh) -> torch.Tensor:
    """Annotate an XLA tensor as split on dim 0 over the data axis, replicated on the rest."""
    xs.mark_sharding(tensor, mesh, ("data",) + (None,) * (tensor.ndim - 1))
    return tensor


def sharding_spec(tensor: torch.Tensor) -> str:
    """The tensor's sharding as XLA prints it (for tests and debugging)."""
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)
