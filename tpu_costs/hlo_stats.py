"""What a compiled TPU program does, read from its optimized HLO text (tpu_compile.py's tables):
the collectives (kind, count, bytes), the bytes each top-level operation moves (grouped by kind,
and the largest fusions with the model code they come from) and XLA's own per-operation cycle
estimates. Plain text parsing, no jax: a test can feed it any HLO text.

Bytes of an operation = the bytes of its result plus those of its operands (each operand's
shape as the instruction that produced it declares it): what the operation reads and writes in
HBM when nothing stays on chip. XLA's `bytes accessed` (the compiler's cost analysis) counts
the same thing with knowledge of slices and in-place updates; the per-operation figures here are
for finding where the bytes go, the program's total is the compiler's.

The compiler's total counts every operand wherever it lives, and the asynchronous copies the
compiler schedules into a chip's on-chip memory (v4's CMEM: layouts marked `S(3)`) on top: a
program that prefetches more counts more bytes while it reads HBM less. `hbm_bytes` counts only
arrays in HBM (layouts without a memory space `S(n)`), each asynchronous copy or slice once per
side in HBM: the traffic the memory-bound estimate is about.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast")
NO_DATA_MOVED = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")  # names and views, no bytes
# An array of a shape's text: dtype, dimensions and (when printed) its layout.
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
ASYNC_MOVES = ("copy-start", "slice-start")
# `%name = SHAPE opcode(operands), attributes`; SHAPE may be a tuple with nested brackets.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")


def _arrays(shape_text: str) -> list[tuple[str, list[int], str]]:
    """(dtype, dimensions, layout) of every array in a shape's text (`f32[4,81]{1,0}`, a tuple of
    them, `bf16[]`); the layout is "" where the text has none."""
    return [(dtype, [int(d) for d in filter(None, dims.split(","))], layout)
            for dtype, dims, layout in _ARRAY.findall(shape_text)]


def shape_bytes(shape_text: str) -> int:
    """Bytes of every array in a shape's text."""
    return int(sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims, _ in _arrays(shape_text)))


def hbm_shape_bytes(shape_text: str) -> int:
    """Bytes of the arrays of a shape that live in HBM: those whose layout names no other memory
    space (`S(n)`: on v4, S(3) is the on-chip CMEM; S(1), S(2) hold scalars and vectors)."""
    return int(sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims, layout in _arrays(shape_text)
                   if "S(" not in layout))


@dataclass
class Operation:
    name: str
    opcode: str
    shape: str
    result_bytes: int
    operands: list[str]
    attributes: str
    operand_bytes: int = 0

    calls_dot: bool = False  # a fusion whose computation holds a matrix multiply
    result_hbm_bytes: int = 0
    operand_hbm_bytes: int = 0

    @property
    def hbm_bytes(self) -> int:
        """Bytes this operation reads and writes in HBM. An asynchronous copy or slice moves its
        destination's bytes: counted once for each of its two sides in HBM."""
        if self.opcode.endswith("-done") or 'custom_call_target="ConcatBitcast"' in self.attributes:
            return 0  # counted by its -start; a concatenation of views, nothing moved
        if self.opcode in ASYNC_MOVES:
            moved = shape_bytes(_tuple_element(self.shape, 1))
            return moved * sum(hbm_shape_bytes(_tuple_element(self.shape, i)) > 0 for i in (0, 1))
        return self.result_hbm_bytes + self.operand_hbm_bytes

    @property
    def bytes(self) -> int:
        if self.opcode.endswith("-done"):
            return 0  # counted by its -start
        if self.opcode.endswith("-start"):
            return self.result_bytes  # the (source, destination, ...) tuple: one read, one write
        return self.result_bytes + self.operand_bytes

    @property
    def plain_shape(self) -> str:
        """The result's shape without its layouts (`f32[4,81]`)."""
        return re.sub(r"\{[^}]*\}", "", self.shape)

    @property
    def kind(self) -> str:
        """A fusion by its name without the number (`convolution_add_fusion.3` ->
        convolution_add_fusion: XLA names fusions by what they fuse), other operations by opcode."""
        if self.opcode == "fusion":
            stem = re.sub(r"(\.\d+)+$", "", self.name)
            return "fusion (dot)" if stem == "fusion" and self.calls_dot else stem
        return self.opcode

    @property
    def estimated_cycles(self) -> int:
        found = re.search(r'"estimated_cycles":"(\d+)"', self.attributes)
        return int(found.group(1)) if found else 0

    @property
    def source(self) -> str:
        """Where the operation comes from: the model code line (torch_xla's source_file and
        source_line when traced with XLA_HLO_DEBUG=1), else the op name of the traced graph."""
        meta = re.search(r"metadata=\{([^}]*)\}", self.attributes)
        if not meta:
            return ""
        fields = dict(re.findall(r'(\w+)="?([^"\s]*)"?', meta.group(1)))
        where = f"{fields['source_file'].rsplit('/', 1)[-1]}:{fields['source_line']}" if "source_file" in fields else ""
        what = fields.get("op_type") or fields.get("op_name", "")
        return " ".join(x for x in (where, what) if x)


@dataclass
class ProgramStats:
    operations: list[Operation] = field(default_factory=list)

    def collectives(self) -> list[dict]:
        """[{kind, count, bytes (of the results), shapes}] of the program's collectives (the async
        `-start` halves counted, their `-done` halves not)."""
        found: dict[str, dict] = {}
        for op in self.operations:
            kind = op.opcode.removesuffix("-start")
            if kind in COLLECTIVES and not op.opcode.endswith("-done"):
                entry = found.setdefault(kind, {"kind": kind, "count": 0, "bytes": 0, "shapes": []})
                entry["count"] += 1
                entry["bytes"] += op.result_bytes
                if op.plain_shape not in entry["shapes"]:
                    entry["shapes"].append(op.plain_shape)
        return sorted(found.values(), key=lambda e: -e["bytes"])

    def bytes_by_kind(self) -> list[dict]:
        """[{kind, count, bytes}] of the top-level operations, most bytes first."""
        kinds: dict[str, dict] = defaultdict(lambda: {"count": 0, "bytes": 0})
        for op in self.operations:
            if op.opcode in NO_DATA_MOVED:
                continue
            kinds[op.kind]["count"] += 1
            kinds[op.kind]["bytes"] += op.bytes
        return sorted(({"kind": k, **v} for k, v in kinds.items()), key=lambda e: -e["bytes"])

    def largest(self, n: int = 10) -> list[dict]:
        """The n operations that move the most bytes, with their shape and source."""
        ops = sorted((op for op in self.operations if op.opcode not in NO_DATA_MOVED), key=lambda op: -op.bytes)[:n]
        return [{"name": op.name, "kind": op.kind, "bytes": op.bytes,
                 "shape": op.plain_shape, "source": op.source} for op in ops]

    def sequence_square_shapes(self, length: int) -> list[str]:
        """The distinct result shapes of top-level operations holding an array whose last two
        dimensions are both `length` (an attention's [..., seq, seq] scores or probabilities)."""
        found = []
        for op in self.operations:
            if op.opcode not in NO_DATA_MOVED and op.plain_shape not in found and \
                    any(dims[-2:] == [length, length] for _, dims, _ in _arrays(op.shape)):
                found.append(op.plain_shape)
        return found

    def hbm_bytes(self) -> int:
        """The bytes the top-level operations read and write in HBM (see the module's docstring)."""
        return sum(op.hbm_bytes for op in self.operations if op.opcode not in NO_DATA_MOVED)

    def estimated_cycles(self) -> int:
        """The sum of XLA's per-operation cycle estimates over the top-level operations."""
        return sum(op.estimated_cycles for op in self.operations)


def _tuple_element(shape_text: str, index: int) -> str:
    """The index-th top-level element of a tuple shape's text ('(a, (b, c), d)' -> '(b, c)' for 1)."""
    depth, start, elements = 0, 1, []
    for i, ch in enumerate(shape_text):
        depth += ch in "({["
        depth -= ch in ")}]"
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            elements.append(shape_text[start:i].strip())
            start = i + 1
    return elements[index]


def computations_with_dots(hlo_text: str) -> set[str]:
    """Names of the computations that hold a matrix multiply (`convolution` or `dot` on TPU)."""
    found, current = set(), None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = header.group(1)
        elif current and re.search(r"\s(convolution|dot)\(", line):
            found.add(current)
    return found


def entry_computation(hlo_text: str) -> list[str]:
    """The lines of the ENTRY computation of an HLO module's text."""
    lines = hlo_text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("ENTRY"):
            body = []
            for rest in lines[i + 1:]:
                if rest.startswith("}"):
                    break
                body.append(rest)
            return body
    raise ValueError("no ENTRY computation in the HLO text")


def parse_program(hlo_text: str) -> ProgramStats:
    """The top-level operations of the ENTRY computation. The compiled training and evaluation
    steps have no loops (every cycle is unrolled in the traced graph), so the entry holds the
    whole step."""
    ops: dict[str, Operation] = {}
    for line in entry_computation(hlo_text):
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, opcode, rest = match.groups()
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):  # the operand list ends at the matching parenthesis
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                end = i
                break
        ops[name] = Operation(name, opcode, shape, shape_bytes(shape), _OPERAND.findall(rest[:end]), rest[end + 1:],
                              result_hbm_bytes=hbm_shape_bytes(shape))
    dots = computations_with_dots(hlo_text)
    for op in ops.values():
        op.operand_bytes = sum(ops[o].result_bytes for o in op.operands if o in ops)
        op.operand_hbm_bytes = sum(ops[o].result_hbm_bytes for o in op.operands if o in ops)
        called = re.search(r"calls=%?([\w.\-]+)", op.attributes)
        op.calls_dot = bool(called and called.group(1) in dots)
    return ProgramStats(list(ops.values()))


def summary(hlo_text: str, top: int = 10, sequence: int | None = None) -> dict:
    """The program's collectives, bytes by kind, largest operations and cycle estimate; with
    `sequence`, also the shapes of its [..., sequence, sequence] results."""
    stats = parse_program(hlo_text)
    return {"collectives": stats.collectives(), "bytes_by_kind": stats.bytes_by_kind(),
            "largest_operations": stats.largest(top), "estimated_cycles": stats.estimated_cycles(),
            "hbm_bytes": stats.hbm_bytes(),
            "sequence_square_shapes": stats.sequence_square_shapes(sequence) if sequence else []}


if __name__ == "__main__":  # python tpu_costs/hlo_stats.py OPTIMIZED_HLO.txt: the summary as JSON
    import sys

    print(json.dumps(summary(open(sys.argv[1]).read()), indent=2))
