"""ARC grids in one place: the 30x30 encoding, augmentations and their inverses, voting, pass@k.

Grids (numpy uint8 arrays of colours 0..9, at most 30x30)
    encode_arc_pair(input, output, row=0, col=0) -> (900 tokens, 900 tokens)
        tokens: 0 pad, 1 end of grid, colours 0..9 -> 2..11, the grids' top-left at (row, col)
    decode_arc_grid(sequence) -> grid        the largest top-left rectangle of colour tokens
    dihedral_transform(grid, transform_id)   the 8 symmetries of the square, numbered as the
                                             reference numbers them; DIHEDRAL_INVERSE undoes them
    augment_arc_grid(grid, transform_id, colour_map) / invert_arc_augmentation(...)
    arc_identifier(task, transform_id, colour_map) -> "task|||t<id>|||<colours>", the
        reference's name of an augmented task; parse_arc_identifier(name) is its inverse
The builder (build_data.build_arc) writes datasets with these; the evaluator below reads them.

The evaluator is the evaluation of the reference implementation (SamsungSAILMontreal/
TinyRecursiveModels, evaluators/arc.py): crop, undo the augmentation, vote across augmentations,
score; with votes summarised per distinct candidate so that hosts exchange small summaries
instead of predictions.

For each evaluated row (an augmented test input of an ARC task and the model's prediction after
the final ACT step):
  1. the prediction is cropped to the largest top-left rectangle of colour tokens (no pad, no
     end-of-grid), as the reference crops (``decode_arc_grid``);
  2. the augmentation recorded in the row's identifier name (``parse_arc_identifier``:
     dihedral transform and colour permutation) is undone (``invert_arc_augmentation``);
  3. the row's test input is found the reference's way: its input sequence is cropped and
     de-augmented the same way, and the resulting grid must equal the ``input`` of one of the
     task's test pairs in ``test_puzzles.json`` (test inputs are never shifted on the canvas);
  4. the de-augmented prediction gets one vote in the pool of (task, test input), together with
     sigmoid(q_halt logit).
Candidates of a pool are ranked by vote count, then by mean sigmoid(q_halt), then (only for
exact ties, which the reference leaves to arrival order) by their bytes, so the ranking does not
depend on how rows were split over hosts. pass@k of a test input: its solution is among the
top k candidates. A task scores the fraction of its test inputs passed; pass@k is the mean over
all tasks of ``test_puzzles.json`` (a task without votes scores 0). pass@2 is the ARC score.

API (numpy arrays in, plain Python out; no torch)
    ev = ArcEvaluator.from_dataset(url, accumulate=False)   # reads identifiers.json and
                                                            # test_puzzles.json (any fsspec URL)
    ev = ArcEvaluator(identifiers, test_puzzles, blank_identifier_id=0, accumulate=False)
    ev.begin()                   # start an evaluation: clears the votes unless accumulate=True
    ev.reset()                   # always clears the votes
    ev.update(batch, preds, q_halt_logits, valid=None)
        batch: dict with "inputs" int [B, 900] and "puzzle_identifiers" int [B] (others ignored)
        preds: int [B, 900] predicted tokens; q_halt_logits: float [B]; valid: bool [B] or None
        Rows with valid False or the blank identifier are skipped.
    s = ev.summary()             # this host's votes: a small picklable dict
    merged = ArcEvaluator.merge([s0, s1, ...])   # e.g. the list from an all-gather of objects
    ev.result(merged, ks=(1, 2, 5, 10)) -> {"pass@1": float, "pass@2": ..., ...}
                                 # REFERENCE_PASS_KS: the k the reference reports
    ev.stats(merged) -> {"voted_rows", "unmatched_rows", "candidates", "unvoted_test_inputs"}
    ev.submission(merged, attempts=2) -> {task: [{"attempt_1": grid, "attempt_2": grid}, ...]}
    write_submission(url, submission) -> url written   # a directory gets "submission.json"
    encode_summary(merged) -> bytes; decode_summary(bytes) -> summary   # the saved votes file

Votes of several evaluations (e.g. the EMA snapshots of one run) are aggregated by merging
their summaries, as the reference votes over every evaluation of a run (aggregated_voting):
a merge of two evaluations' summaries equals one evaluation that saw both sets of rows.

A summary is {"votes": {(task, input_key): {candidate_key: [count, q_sum]}}, "voted_rows": int,
"unmatched_rows": int}, where a key is the grid itself as bytes (rows, columns, then the
colours row by row; no hash, no collisions) and q_sum is the sum of sigmoid(q_halt) in units of
2**-64 as a Python int, so merging is exact and independent of the order of hosts. Its size
grows with the number of distinct candidates (at most the number of rows voted), never with the
number of evaluations or hosts; merging is a sum. ``merge`` of one summary is a copy of it.

The saved form of a summary (``encode_summary``, VOTES_FILE) is gzipped JSON, no pickle:
    {"format": "trm-arc-votes/1", "voted_rows": int, "unmatched_rows": int,
     "pools": [[task, input key as hex, [[candidate key as hex, count, q_sum as a decimal
                string], ...]], ...]}
with pools and candidates sorted by key, so equal summaries encode to equal bytes. Keys are
hex so that any byte survives; q_sum is a string because it exceeds a double's 53 bits.

Rows whose task is not in ``test_puzzles.json`` or whose de-augmented input matches none of the
task's test inputs are counted in "unmatched_rows" and otherwise ignored (the reference stores
them but never uses them). Two identical test inputs of one task share one pool, as in the
reference. A test input without votes gets 1x1 grids [[0]] in the submission (the reference
leaves it out, which misaligns the task's list with its test inputs).

This module imports numpy, the standard library, rundir/storage.py and data.py (for reading a
dataset's identifiers) only: never torch.
"""
from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence

import numpy as np

from data import DatasetError, read_identifiers
from rundir.storage import join_url, read_json, write_bytes

# --------------------------------------------------------------------------------------------
# Grids: the sequence encoding, augmentations, identifier names
# --------------------------------------------------------------------------------------------

ARC_GRID_SIZE = 30  # grids are placed on a 30x30 canvas: seq_len 900
ARC_ID_SEPARATOR = "|||"  # identifier of an augmented task: "task|||t<transform>|||<colour map>"
ARC_PAD, ARC_EOS, ARC_FIRST_COLOUR = 0, 1, 2  # tokens: pad, end of grid, colours 0..9 -> 2..11


def dihedral_transform(grid: np.ndarray, transform_id: int) -> np.ndarray:
    """One of the 8 symmetries of the square, numbered as in the reference: 0 identity,
    1-3 rotations by 90/180/270 degrees, 4 left-right flip, 5 up-down flip, 6 transpose,
    7 anti-transpose."""
    if transform_id == 0:
        return grid
    if transform_id in (1, 2, 3):
        return np.rot90(grid, k=transform_id)
    if transform_id == 4:
        return np.fliplr(grid)
    if transform_id == 5:
        return np.flipud(grid)
    if transform_id == 6:
        return grid.T
    if transform_id == 7:
        return np.fliplr(np.rot90(grid, k=1))
    raise ValueError(f"dihedral transform id {transform_id} must lie in 0..7")


DIHEDRAL_INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)  # the rotations by 90 and 270 undo each other


def arc_identifier(task: str, transform_id: int, colour_map: Sequence[int]) -> str:
    """The reference's name of ``task`` augmented by a dihedral transform and colour map."""
    colours = "".join(str(int(c)) for c in colour_map)
    return f"{task}{ARC_ID_SEPARATOR}t{transform_id}{ARC_ID_SEPARATOR}{colours}"


def parse_arc_identifier(name: str) -> tuple[str, int, np.ndarray]:
    """(task, transform_id, colour_map) of an identifiers.json entry; an unaugmented task gives
    the identity transform and colour map."""
    if ARC_ID_SEPARATOR not in name:
        return name, 0, np.arange(10, dtype=np.uint8)
    task, transform, colours = name.rsplit(ARC_ID_SEPARATOR, 2)
    return task, int(transform[1:]), np.array([int(c) for c in colours], dtype=np.uint8)


def augment_arc_grid(grid: np.ndarray, transform_id: int, colour_map: Sequence[int]) -> np.ndarray:
    """Recolour (colour c becomes colour_map[c]) then apply the dihedral transform."""
    return dihedral_transform(np.asarray(colour_map, dtype=np.uint8)[grid], transform_id)


def invert_arc_augmentation(grid: np.ndarray, transform_id: int,
                            colour_map: Sequence[int]) -> np.ndarray:
    """Undo augment_arc_grid: map a grid of the augmented task back to the original task."""
    inverse_colours = np.argsort(np.asarray(colour_map)).astype(np.uint8)
    return inverse_colours[dihedral_transform(np.asarray(grid), DIHEDRAL_INVERSE[transform_id])]


def encode_arc_pair(inp: np.ndarray, out: np.ndarray, row: int = 0,
                    col: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Both grids as 900-token sequences, their top-left corner at (row, col) of the canvas,
    each closed by end-of-grid tokens below and to its right (where the canvas has room)."""
    sequences = []
    for grid in (inp, out):
        rows, cols = grid.shape
        canvas = np.full((ARC_GRID_SIZE, ARC_GRID_SIZE), ARC_PAD, np.uint8)
        canvas[row:row + rows, col:col + cols] = grid + ARC_FIRST_COLOUR
        if row + rows < ARC_GRID_SIZE:
            canvas[row + rows, col:col + cols] = ARC_EOS
        if col + cols < ARC_GRID_SIZE:
            canvas[row:row + rows, col + cols] = ARC_EOS
        sequences.append(canvas.ravel())
    return sequences[0], sequences[1]


def decode_arc_grid(sequence: np.ndarray) -> np.ndarray:
    """The grid at the top-left of a 900-token sequence (a prediction, or an unshifted test
    example): the largest top-left rectangle of colour tokens, as the reference crops."""
    is_colour = (sequence.reshape(ARC_GRID_SIZE, ARC_GRID_SIZE) >= ARC_FIRST_COLOUR) & \
                (sequence.reshape(ARC_GRID_SIZE, ARC_GRID_SIZE) < ARC_FIRST_COLOUR + 10)
    leading = np.cumprod(is_colour, axis=1).sum(axis=1)  # colour cells before the first other
    widths = np.minimum.accumulate(leading)
    areas = widths * np.arange(1, ARC_GRID_SIZE + 1)
    rows = int(np.argmax(areas)) + 1
    cols = int(widths[rows - 1]) if areas[rows - 1] else 0
    rows = rows if cols else 0
    grid = sequence.reshape(ARC_GRID_SIZE, ARC_GRID_SIZE)[:rows, :cols]
    return (grid - ARC_FIRST_COLOUR).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# The evaluator
# --------------------------------------------------------------------------------------------

Q_SCALE = 2 ** 64  # q_sum unit: sigmoid values are summed as integers of 2**-64
SUBMISSION_FILE = "submission.json"
EMPTY_ATTEMPT = [[0]]  # the attempt written for a test input without any votes
REFERENCE_PASS_KS = (1, 2, 5, 10, 100, 1000)  # the pass@k the reference reports
VOTES_FILE = "arc_votes.json.gz"  # an evaluation's merged summary, see encode_summary
VOTES_FORMAT = "trm-arc-votes/1"


def grid_key(grid: np.ndarray) -> bytes:
    """The exact bytes of a grid of colours 0..9: its shape, then its cells row by row."""
    grid = np.ascontiguousarray(grid, dtype=np.uint8)
    if grid.ndim != 2:
        raise ValueError(f"an ARC grid must be 2-D, got shape {grid.shape}")
    return bytes(grid.shape) + grid.tobytes()


def key_grid(key: bytes) -> np.ndarray:
    """Inverse of grid_key."""
    rows, cols = key[0], key[1]
    return np.frombuffer(key, dtype=np.uint8, offset=2).reshape(rows, cols)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """Float64 logistic function, without overflow warnings for large logits."""
    logits = np.asarray(logits, dtype=np.float64)
    return np.exp(-np.logaddexp(0.0, -logits))


def _empty_summary() -> dict:
    return {"votes": {}, "voted_rows": 0, "unmatched_rows": 0}


class ArcEvaluator:
    """Votes of one host over one evaluation; see the module docstring."""

    def __init__(self, identifiers: Sequence[str], test_puzzles: dict,
                 blank_identifier_id: int = 0, accumulate: bool = False):
        self.identifiers = list(identifiers)
        self.test_puzzles = test_puzzles
        self.blank_identifier_id = blank_identifier_id
        self.accumulate = accumulate
        # (task, input key) of every test pair, and the solution key of each test pair in order.
        self._pools = set()
        self._solutions = {}
        for task, puzzle in test_puzzles.items():
            try:
                pairs = puzzle["test"]
                self._solutions[task] = [(grid_key(np.array(p["input"])),
                                          grid_key(np.array(p["output"]))) for p in pairs]
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"test_puzzles task {task!r} is malformed ({exc!r}); expected "
                                 '{"test": [{"input": grid, "output": grid}, ...]}') from exc
            self._pools.update((task, input_key) for input_key, _ in self._solutions[task])
        self._parsed = {}  # identifier id -> (task, transform id, colour map)
        self._summary = _empty_summary()

    @classmethod
    def from_dataset(cls, url: str, **kwargs) -> ArcEvaluator:
        """The evaluator of the ARC dataset at ``url`` (local path or fsspec URL)."""
        identifiers = read_identifiers(url)
        puzzles_url = join_url(url, "test_puzzles.json")
        try:
            test_puzzles = read_json(puzzles_url, "ARC test puzzles", DatasetError)
        except FileNotFoundError:
            raise DatasetError(f"{puzzles_url} is missing: the ARC evaluator needs the "
                               "test_puzzles.json that `python build_data.py build-arc` writes."
                               ) from None
        return cls(identifiers, test_puzzles, **kwargs)

    # ---------------------------------------------------------------------------------------
    # Voting
    # ---------------------------------------------------------------------------------------

    def begin(self) -> None:
        """Start an evaluation: votes of earlier evaluations are dropped unless accumulating."""
        if not self.accumulate:
            self.reset()

    def reset(self) -> None:
        self._summary = _empty_summary()

    def _augmentation(self, identifier: int) -> tuple:
        parsed = self._parsed.get(identifier)
        if parsed is None:
            if not 0 <= identifier < len(self.identifiers):
                raise ValueError(f"puzzle identifier {identifier} is outside identifiers.json "
                                 f"(0..{len(self.identifiers) - 1}); evaluate with the dataset "
                                 "the evaluator was built from.")
            parsed = parse_arc_identifier(self.identifiers[identifier])
            self._parsed[identifier] = parsed
        return parsed

    def original_grid(self, sequence: np.ndarray, identifier: int) -> tuple[str, np.ndarray]:
        """(task, grid): the grid at the top-left of a 900-token sequence of puzzle
        ``identifier``, cropped and mapped back to the unaugmented task."""
        task, transform_id, colour_map = self._augmentation(int(identifier))
        grid = decode_arc_grid(np.asarray(sequence))
        return task, invert_arc_augmentation(grid, transform_id, colour_map)

    def update(self, batch: dict, preds: np.ndarray, q_halt_logits: np.ndarray,
               valid: np.ndarray | None = None) -> None:
        """Add one vote per real row of a batch (this host's rows)."""
        inputs = np.asarray(batch["inputs"])
        identifiers = np.asarray(batch["puzzle_identifiers"]).reshape(-1)
        preds = np.asarray(preds)
        # A diverged model's NaN q_halt: the vote still counts, with no confidence (int(NaN) raises).
        q = np.nan_to_num(sigmoid(np.asarray(q_halt_logits).reshape(-1)), nan=0.0)
        rows = len(identifiers)
        if inputs.shape[0] != rows or preds.shape[0] != rows or len(q) != rows:
            raise ValueError(f"update: inputs {inputs.shape}, preds {preds.shape}, q_halt_logits "
                             f"{q.shape} and puzzle_identifiers {identifiers.shape} must have "
                             "the same number of rows")
        keep = identifiers != self.blank_identifier_id
        if valid is not None:
            keep &= np.asarray(valid, dtype=bool).reshape(-1)
        votes = self._summary["votes"]
        for row in np.flatnonzero(keep):
            task, original_input = self.original_grid(inputs[row], identifiers[row])
            pool = (task, grid_key(original_input))
            if pool not in self._pools:
                self._summary["unmatched_rows"] += 1
                continue
            _, prediction = self.original_grid(preds[row], identifiers[row])
            stats = votes.setdefault(pool, {}).setdefault(grid_key(prediction), [0, 0])
            stats[0] += 1
            stats[1] += int(q[row] * Q_SCALE)  # exact: scaling by a power of two
            self._summary["voted_rows"] += 1

    def summary(self) -> dict:
        """This host's votes (a picklable dict of builtins; a copy, safe to send)."""
        return self.merge([self._summary])

    # ---------------------------------------------------------------------------------------
    # Merging and scoring (any host, usually host 0 after gathering every host's summary)
    # ---------------------------------------------------------------------------------------

    @staticmethod
    def merge(summaries: Iterable[dict]) -> dict:
        """The sum of several hosts' summaries."""
        merged = _empty_summary()
        votes = merged["votes"]
        for summary in summaries:
            merged["voted_rows"] += summary["voted_rows"]
            merged["unmatched_rows"] += summary["unmatched_rows"]
            for pool, candidates in summary["votes"].items():
                target = votes.setdefault(pool, {})
                for key, (count, q_sum) in candidates.items():
                    stats = target.setdefault(key, [0, 0])
                    stats[0] += count
                    stats[1] += q_sum
        return merged

    @staticmethod
    def ranked(candidates: dict) -> list:
        """Candidate keys of one pool, best first: most votes, then highest mean
        sigmoid(q_halt), then smallest key."""
        return sorted(candidates, key=lambda k: (-candidates[k][0],
                                                 -(candidates[k][1] / candidates[k][0]), k))

    def _rankings(self, merged: dict):
        """(task, [(ranked candidate keys, solution key) per test input]) for every task."""
        votes = merged["votes"]
        for task, pairs in self._solutions.items():
            yield task, [(self.ranked(votes.get((task, input_key), {})), solution)
                         for input_key, solution in pairs]

    def result(self, merged: dict, ks: Sequence[int] = (1, 2, 5, 10)) -> dict:
        """{"pass@k": mean over tasks of the fraction of its test inputs whose solution is
        among the top k candidates}."""
        if any(int(k) < 1 for k in ks):
            raise ValueError(f"pass@k needs k >= 1, got {list(ks)}")
        totals = {int(k): 0.0 for k in ks}
        for _, tests in self._rankings(merged):
            for k in totals:
                totals[k] += sum(solution in ranked[:k] for ranked, solution in tests) / len(tests)
        num_tasks = max(len(self._solutions), 1)
        return {f"pass@{k}": total / num_tasks for k, total in totals.items()}

    def stats(self, merged: dict) -> dict:
        """Counts for the log: rows voted, rows matching no test input, distinct candidates,
        test inputs without any vote."""
        unvoted = sum(not ranked for _, tests in self._rankings(merged) for ranked, _ in tests)
        return {"voted_rows": merged["voted_rows"], "unmatched_rows": merged["unmatched_rows"],
                "candidates": sum(len(c) for c in merged["votes"].values()),
                "unvoted_test_inputs": unvoted}

    def submission(self, merged: dict, attempts: int = 2) -> dict:
        """ARC-Prize submission: {task: [{"attempt_1": grid, ..., "attempt_<attempts>": grid}
        per test input]}; missing attempts repeat the best candidate, as in the reference."""
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        result = {}
        for task, tests in self._rankings(merged):
            entries = []
            for ranked, _ in tests:
                grids = [key_grid(k).tolist() for k in ranked[:attempts]] or [EMPTY_ATTEMPT]
                grids += [grids[0]] * (attempts - len(grids))
                entries.append({f"attempt_{i + 1}": g for i, g in enumerate(grids)})
            result[task] = entries
        return result


def encode_summary(summary: dict) -> bytes:
    """The exact, pickle-free bytes of a summary (see the module docstring); equal summaries
    give equal bytes."""
    pools = [[task, input_key.hex(),
              [[key.hex(), count, str(q_sum)] for key, (count, q_sum) in sorted(candidates.items())]]
             for (task, input_key), candidates in sorted(summary["votes"].items())]
    document = {"format": VOTES_FORMAT, "voted_rows": summary["voted_rows"],
                "unmatched_rows": summary["unmatched_rows"], "pools": pools}
    # mtime=0: no timestamp in the header, so the bytes depend on the votes only.
    return gzip.compress(json.dumps(document, separators=(",", ":")).encode(), compresslevel=6,
                         mtime=0)


def decode_summary(payload: bytes, source: str = "ARC votes") -> dict:
    """Inverse of encode_summary; ValueError naming ``source`` if the bytes are not a votes
    file of this format."""
    try:
        document = json.loads(gzip.decompress(payload))
        if document.get("format") != VOTES_FORMAT:
            raise ValueError(f"format {document.get('format')!r}, expected {VOTES_FORMAT!r}")
        summary = _empty_summary()
        for name in ("voted_rows", "unmatched_rows"):
            if type(document[name]) is not int or document[name] < 0:
                raise ValueError(f"{name} {document[name]!r} is not a count")
            summary[name] = document[name]
        for task, input_hex, candidates in document["pools"]:
            pool = summary["votes"].setdefault((str(task), bytes.fromhex(input_hex)), {})
            for key_hex, count, q_sum in candidates:
                if type(count) is not int or count < 1 or type(q_sum) is not str or not q_sum.isdigit():
                    raise ValueError(f"candidate count {count!r} / q_sum {q_sum!r} are not counts")
                pool[bytes.fromhex(key_hex)] = [count, int(q_sum)]
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{source} is not a readable ARC votes file ({type(exc).__name__}: {exc}); "
                         "delete it, or evaluate that step again to rewrite it") from exc
    return summary


def write_submission(url: str, submission: dict) -> str:
    """Write ``submission`` as JSON to ``url`` (local or fsspec); a URL not ending in ".json" is
    a directory that gets "submission.json". Returns the file's URL."""
    if not url.endswith(".json"):
        url = join_url(url, SUBMISSION_FILE)
    write_bytes(url, json.dumps(submission).encode())
    return url
