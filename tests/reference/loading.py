"""Running the references' own code beside ours (ours, not theirs): their modules imported under
their own package names, and the one stand-in their attention needs off a GPU with flash-attn.
Used by tests/test_eqr.py, test_convergence_selection.py, test_maze_unique.py,
tests/reference/gpu_side_by_side.py and tests/reference/urm/record_urm.py."""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch.nn.functional as F

THEIR_PACKAGES = ("models", "utils", "config", "evaluators")
"""The top-level packages of the TRM reference, EqR and URM (each has a `models`)."""


def load_family(folder: Path, *names: str, stand_ins: dict[str, dict] | None = None,
                packages: tuple[str, ...] = ()) -> list[types.ModuleType]:
    """Modules `names` of the reference in `folder`, imported with it first on sys.path under their
    own package names, which are then put back as they were, so that the references' `models`
    packages do not collide. `stand_ins`: modules installed for the import (name -> attributes:
    a package not installed here, or one imported only for annotations); `packages`: other
    top-level names the import brings in, put back too."""
    stand_ins = stand_ins or {}
    tops = {*THEIR_PACKAGES, *packages, *(name.split(".")[0] for name in (*names, *stand_ins))}
    theirs = lambda name: name.split(".")[0] in tops
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if theirs(name)}
    for name, attributes in stand_ins.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attributes)
    sys.path.insert(0, str(folder))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(folder))
        for name in [name for name in sys.modules if theirs(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


def install_flash_attn_shim() -> None:
    """`flash_attn_interface.flash_attn_func` (URM's attention imports it unconditionally, EqR's
    calls it on CUDA tensors) as torch's scaled_dot_product_attention on [batch, seq, heads,
    head_dim] tensors: the same default scale 1/sqrt(head_dim), causal as asked."""
    def flash_attn_func(q, k, v, causal=False, **_):
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return y.transpose(1, 2).contiguous()

    shim = types.ModuleType("flash_attn_interface")
    shim.flash_attn_func = flash_attn_func
    sys.modules["flash_attn_interface"] = shim
