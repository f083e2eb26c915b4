"""Config fields that declare their allowed range: `ranged(default, ge=..., note=...)` on a
dataclass field, and `range_problems(instance)` listing the fields outside their range. Every
config section uses it (model.TRMConfig, training/config.py's sections); config.check_config reports the
problems as flags before a run starts. Plain Python: model.py imports it."""
from __future__ import annotations

import dataclasses
import math

_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def ranged(default, *, ge=None, gt=None, le=None, lt=None, note: str = "", **metadata):
    """A dataclass field that declares its allowed range (ge: >=, gt: >, le: <=, lt: <) in its
    metadata, with `note`, what to do about a value outside it; `range_problems` reports the
    fields outside their range (config.check_config runs it on every config section before a run
    starts). Other metadata (e.g. training/config.py's resumable) passes through."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return dataclasses.field(default=default, metadata={**metadata, "range": bounds, "note": note})


def _rule(bounds: dict) -> str:
    """"must be ..." text of a range: ">= 1", "> 0", "in [0, 1)"."""
    low = next(((k, bounds[k]) for k in ("ge", "gt") if k in bounds), None)
    high = next(((k, bounds[k]) for k in ("le", "lt") if k in bounds), None)
    if low and high:
        return f"in {'[' if low[0] == 'ge' else '('}{low[1]}, {high[1]}{']' if high[0] == 'le' else ')'}"
    kind, bound = low or high
    return f"{_BOUNDS[kind][0]} {bound}"


def range_problems(config) -> list[tuple[str, object, str, str]]:
    """(field name, value, "must be ..." rule, the field's note) of every field of the dataclass
    instance `config` declared with `ranged` whose value is outside its range, not a number, or
    not finite. None passes: it is how optional fields say "not given"."""
    problems = []
    for f in dataclasses.fields(config):
        bounds = f.metadata.get("range")
        value = getattr(config, f.name)
        if not bounds or value is None:
            continue
        rule = _rule(bounds)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or isinstance(value, float) and not math.isfinite(value):
            problems.append((f.name, value, f"a finite number {rule}", f.metadata["note"]))
        elif not all(_BOUNDS[kind][1](value, bound) for kind, bound in bounds.items()):
            problems.append((f.name, value, rule, f.metadata["note"]))
    return problems
