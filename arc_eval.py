"""ARC pass@k evaluator: crop, undo the augmentation, vote across augmentations, score.

The evaluation of the reference implementation (SamsungSAILMontreal/TinyRecursiveModels,
evaluators/arc.py), with votes summarised per distinct candidate so that hosts exchange small
summaries instead of predictions.

For each evaluated row (an augmented test input of an ARC task and the model's prediction after
the final ACT step):
  1. the prediction is cropped to the largest top-left rectangle of colour tokens (no pad, no
     end-of-grid), as the reference crops (``data.decode_arc_grid``);
  2. the augmentation recorded in the row's identifier name (``data.parse_arc_identifier``:
     dihedral transform and colour permutation) is undone (``data.invert_arc_augmentation``);
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

This module imports numpy, the standard library, storage.py and data.py only.
"""
from __future__ import annotations

import gzip
import json
from typing import Iterable, Optional, Sequence

import numpy as np

import data
from storage import join_url, read_json, write_bytes

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
    def from_dataset(cls, url: str, **kwargs) -> "ArcEvaluator":
        """The evaluator of the ARC dataset at ``url`` (local path or fsspec URL)."""
        identifiers = data.read_identifiers(url)
        puzzles_url = join_url(url, "test_puzzles.json")
        try:
            test_puzzles = read_json(puzzles_url, "ARC test puzzles", data.DatasetError)
        except FileNotFoundError:
            raise data.DatasetError(f"{puzzles_url} is missing: the ARC evaluator needs the "
                                    "test_puzzles.json that `python data.py build-arc` writes."
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
            parsed = data.parse_arc_identifier(self.identifiers[identifier])
            self._parsed[identifier] = parsed
        return parsed

    def original_grid(self, sequence: np.ndarray, identifier: int) -> tuple[str, np.ndarray]:
        """(task, grid): the grid at the top-left of a 900-token sequence of puzzle
        ``identifier``, cropped and mapped back to the unaugmented task."""
        task, transform_id, colour_map = self._augmentation(int(identifier))
        grid = data.decode_arc_grid(np.asarray(sequence))
        return task, data.invert_arc_augmentation(grid, transform_id, colour_map)

    def update(self, batch: dict, preds: np.ndarray, q_halt_logits: np.ndarray,
               valid: Optional[np.ndarray] = None) -> None:
        """Add one vote per real row of a batch (this host's rows)."""
        inputs = np.asarray(batch["inputs"])
        identifiers = np.asarray(batch["puzzle_identifiers"]).reshape(-1)
        preds = np.asarray(preds)
        q = sigmoid(np.asarray(q_halt_logits).reshape(-1))
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
