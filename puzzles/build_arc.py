"""The ARC-AGI builder: ARC tasks (Kaggle-layout challenges and solutions files) in the
reference format, with the reference's augmentations, shifts and identifiers:

    build_arc(out, input_prefix, subsets, test_sets, num_aug, seed=ARC_SEED)

writes, byte for byte, what the reference's dataset/build_arc_dataset.py writes from the same
files and options (seed 42 by default), so a reference ARC checkpoint finds its own puzzle
identifiers. `python build_data.py build-arc --help` is its command line. Imports numpy,
rundir/storage.py, data.py and puzzles/arc.py (never torch).
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data import SPLITS, DatasetError, SplitAccumulator, write_identifiers
from puzzles.arc import ARC_FIRST_COLOUR, ARC_GRID_SIZE, arc_identifier, augment_arc_grid, encode_arc_pair
from rundir.storage import join_url, read_json, write_bytes

ARC_AUGMENT_RETRIES = 5  # tries per wanted augmentation before giving up on duplicates
ARC_SEED = 42  # the reference builder's default: with it, its checkpoints' embeddings line up


def _arc_grid(value, where: str) -> np.ndarray:
    try:
        grid = np.array(value)
    except ValueError:  # ragged rows
        grid = np.zeros(0)
    if grid.ndim != 2 or not (1 <= grid.shape[0] <= ARC_GRID_SIZE) \
            or not (1 <= grid.shape[1] <= ARC_GRID_SIZE) or grid.dtype.kind not in "iu" \
            or grid.min() < 0 or grid.max() > 9:
        raise DatasetError(f"{where}: an ARC grid must be a rectangular list of lists of colours "
                           f"0..9, at most {ARC_GRID_SIZE}x{ARC_GRID_SIZE}.")
    return grid.astype(np.uint8)


def load_arc_tasks(challenges_url: str, solutions_url: str | None) -> dict:
    """{task: task} of one ARC-AGI challenges file (Kaggle layout) as its JSON values,
    {"train": [{"input", "output"}], "test": [{"input", "output"}]}, in file order.

    Each test pair's "output" comes from the solutions file (its n-th solution is the n-th test
    pair's); without that file, tests keep any "output" they carry, else a dummy 1x1 grid [[0]],
    as the reference does. The values stay raw JSON: test_puzzles.json repeats them verbatim."""
    try:
        tasks = read_json(challenges_url, "ARC challenges", DatasetError)
    except FileNotFoundError:
        raise DatasetError(f"ARC challenges file {challenges_url} not found; check --input-prefix "
                           "and --subsets.") from None
    solutions = None
    if solutions_url is not None:
        try:
            solutions = read_json(solutions_url, "ARC solutions", DatasetError)
        except FileNotFoundError:
            print(f"data: {solutions_url} not found; test outputs of {challenges_url} are dummies",
                  file=sys.stderr)
    if not isinstance(tasks, dict):
        raise DatasetError(f"{challenges_url} must map task names to tasks, found "
                           f"{type(tasks).__name__}.")
    if solutions is not None and not isinstance(solutions, dict):
        raise DatasetError(f"{solutions_url} must map task names to lists of test outputs, found "
                           f"{type(solutions).__name__}.")
    for name, task in tasks.items():
        where = f"{challenges_url} task {name!r}"
        layout = ('expected {"train": [{"input", "output"}, ...], '
                  '"test": [{"input"}, ...]}')
        if not isinstance(task, dict) or not isinstance(task.get("test"), list) \
                or not all(isinstance(e, dict) for e in task["test"]):
            raise DatasetError(f"{where} is malformed: {layout}.")
        unknown = [kind for kind in task if kind not in ("train", "test")]
        if unknown:
            raise DatasetError(f"{where} has the key(s) {unknown}; {layout}.")
        if solutions is None:
            for test in task["test"]:
                test.setdefault("output", [[0]])
            continue
        if name not in solutions:
            raise DatasetError(f"{solutions_url} has no solution for task {name!r}; add it or "
                               "remove the task from the challenges file.")
        if not isinstance(solutions[name], list) or len(solutions[name]) > len(task["test"]):
            raise DatasetError(f"{solutions_url}: task {name!r} needs a list of at most "
                               f"{len(task['test'])} test outputs (one per test input).")
        for test, solution in zip(task["test"], solutions[name]):
            test["output"] = solution
    return tasks


def _arc_task_pairs(task: dict, in_test_set: bool, where: str) -> dict:
    """{"train": [(input, output)], "test": [...]} of a raw task: the pairs in the order of the
    task's keys (so a task listing "test" first puts those pairs first, as the reference does).
    A task of a test set sends its test pairs to the test split, any other task to train."""
    pairs = {"train": [], "test": []}
    for kind, examples in task.items():
        split = "test" if kind == "test" and in_test_set else "train"
        try:
            pairs[split].extend((_arc_grid(e["input"], where), _arc_grid(e["output"], where))
                                for e in examples)
        except (KeyError, TypeError) as exc:
            raise DatasetError(f"{where}: every {kind!r} pair needs an \"input\" and an "
                               f"\"output\" grid (a test output may come from the solutions "
                               f"file); found a problem with {exc!r}.") from exc
    for split in ("train", "test") if in_test_set else ("train",):
        if not pairs[split]:
            raise DatasetError(f"{where} has no pairs for the {split} split; a task of a test set "
                               "needs both train and test pairs.")
    return pairs


def _arc_variant_hash(examples: dict) -> bytes:
    """Order-independent fingerprint of all (input, output) pairs of a task variant, over both
    splits: two variants with the same multiset of pairs are duplicates."""
    pairs = sorted(bytes(a.shape) + a.tobytes() + bytes(b.shape) + b.tobytes()
                   for split_pairs in examples.values() for a, b in split_pairs)
    return hashlib.sha256(b"".join(pairs)).digest()


def _arc_variants(name: str, examples: dict, num_aug: int,
                  rng: np.random.RandomState) -> tuple[list, np.ndarray]:
    """The task and up to ``num_aug`` distinct augmentations of it: (identifiers, plans), where
    plans[i] is uint8 [transform_id, colour_map[0..9]] of identifiers[i] (row 0, the task
    itself, is the identity). Only the plans are kept: the grids are cheap to redo when
    encoding, and full ARC with 1000 augmentations would otherwise hold a million grid sets.

    An augmentation is a random dihedral transform then a random permutation of colours 1..9
    (0, the background, stays), drawn with the reference's legacy calls in its order:
    randint(0, 8), then permutation of the 9 colours. One that reproduces the task or an
    earlier augmentation is dropped; at most ARC_AUGMENT_RETRIES * num_aug draws are made."""
    identity = np.concatenate([[0], np.arange(10)]).astype(np.uint8)
    identifiers, plans = [name], [identity]
    seen = {_arc_variant_hash(examples)}
    for _ in range(ARC_AUGMENT_RETRIES * num_aug):
        if len(identifiers) > num_aug:
            break
        transform_id = rng.randint(0, 8)
        colour_map = np.concatenate([[0], rng.permutation(9) + 1]).astype(np.uint8)
        augmented = {split: [(augment_arc_grid(a, transform_id, colour_map),
                              augment_arc_grid(b, transform_id, colour_map)) for a, b in pairs]
                     for split, pairs in examples.items()}
        fingerprint = _arc_variant_hash(augmented)
        if fingerprint not in seen:
            seen.add(fingerprint)
            identifiers.append(arc_identifier(name, transform_id, colour_map))
            plans.append(np.concatenate([[transform_id], colour_map]).astype(np.uint8))
    if len(identifiers) <= num_aug:
        print(f"data: ARC task {name} has only {len(identifiers)} distinct variants",
              file=sys.stderr)
    return identifiers, np.stack(plans)


@dataclass
class _ArcTask:
    """One task of the build, in the order tasks are drawn."""

    pairs: dict
    """{"train": [(input, output)], "test": [...]}: the unaugmented pairs of each split."""
    splits: tuple
    """The splits the task contributes a group to: ("train",) or ("train", "test")."""
    identifiers: list
    """Names of the task and its kept augmentations (identifiers.json entries)."""
    plans: np.ndarray
    """uint8 [variants, 11]: transform id and colour map of each identifier."""


def build_arc(out: str, input_prefix: str,
              subsets: Sequence[str] = ("training", "evaluation", "concept"),
              test_sets: Sequence[str] = ("evaluation",), num_aug: int = 1000,
              seed: int = ARC_SEED) -> None:
    """ARC-AGI in the reference format from ``{input_prefix}_{subset}_challenges.json`` (and
    ``_solutions.json``) files; with the same files, subsets, test sets, ``num_aug`` and
    ``seed``, every file is byte-identical to the reference's build_arc_dataset.py output.

    Every task is a group: itself plus up to ``num_aug`` distinct augmentations, each a puzzle
    with its own identifier. Tasks of ``test_sets`` put their train pairs in the train split and
    their test pairs in the test split (and into test_puzzles.json); other tasks put all pairs
    in the train split. In the train split every example but one random one per puzzle is
    shifted to a random place on the canvas.

    The random draws are the reference's legacy numpy calls, in its order, from one
    RandomState(seed) (the stream of np.random.seed(seed)): per subset a shuffle of its tasks,
    then each task's augmentation draws; after all tasks, split by split (train, then test),
    group by group and puzzle by puzzle, the unshifted example and each shift.
    """
    if not any(name in subsets for name in test_sets):
        raise DatasetError(f"none of the test sets {list(test_sets)} is among the subsets "
                           f"{list(subsets)}; the test split would be empty. Add the test set to "
                           "--subsets or name one of them with --test-sets.")
    rng = np.random.RandomState(seed)
    tasks, test_tasks = [], {}
    for subset in subsets:
        challenges_url = f"{input_prefix}_{subset}_challenges.json"
        raw = load_arc_tasks(challenges_url, f"{input_prefix}_{subset}_solutions.json")
        in_test_set = subset in test_sets
        names = list(raw)
        rng.shuffle(names)
        for name in names:
            if in_test_set:
                test_tasks[name] = raw[name]
            pairs = _arc_task_pairs(raw[name], in_test_set, f"{challenges_url} task {name!r}")
            identifiers, plans = _arc_variants(name, pairs, num_aug, rng)
            tasks.append(_ArcTask(pairs, ("train", "test") if in_test_set else ("train",),
                                  identifiers, plans))
    # The reference numbers identifiers in the order the splits first receive a group, then
    # group by group. Every task feeds train, so train comes first. (When the first subset is
    # a test set, the reference's order comes from iterating a Python set of the two splits,
    # which varies with PYTHONHASHSEED; train first is one of its two outcomes.)
    identifier_ids = {}
    for split in SPLITS:
        for task in tasks:
            if split in task.splits:
                for identifier in task.identifiers:
                    identifier_ids.setdefault(identifier, len(identifier_ids) + 1)
    with tempfile.TemporaryDirectory() as workdir:
        for split in SPLITS:
            accumulator = SplitAccumulator(ARC_GRID_SIZE ** 2, workdir, split)
            for task in tasks:
                if split in task.splits:
                    _add_arc_group(accumulator, task.pairs[split], task.plans,
                                   [identifier_ids[i] for i in task.identifiers],
                                   shift=split == "train", rng=rng)
            accumulator.write(out, split, vocab_size=ARC_FIRST_COLOUR + 10,
                              num_puzzle_identifiers=len(identifier_ids) + 1)
    write_identifiers(out, ["<blank>"] + list(identifier_ids))
    write_bytes(join_url(out, "test_puzzles.json"), json.dumps(test_tasks).encode())


def _add_arc_group(accumulator: SplitAccumulator, pairs: list, plans: np.ndarray, ids: list,
                   shift: bool, rng: np.random.RandomState) -> None:
    """Encode one task's pairs of one split, in each variant of ``plans``, as one group."""
    inputs, labels = [], []
    for plan in plans:
        transform_id, colour_map = int(plan[0]), plan[1:]
        unshifted = rng.randint(0, len(pairs))  # one example per puzzle stays at the corner
        for index, (a, b) in enumerate(pairs):
            a = augment_arc_grid(a, transform_id, colour_map)
            b = augment_arc_grid(b, transform_id, colour_map)
            row = col = 0
            if shift and index != unshifted:
                row = rng.randint(0, ARC_GRID_SIZE - max(a.shape[0], b.shape[0]) + 1)
                col = rng.randint(0, ARC_GRID_SIZE - max(a.shape[1], b.shape[1]) + 1)
            encoded_input, encoded_label = encode_arc_pair(a, b, row, col)
            inputs.append(encoded_input)
            labels.append(encoded_label)
    accumulator.add_group(np.stack(inputs), np.stack(labels), [len(pairs)] * len(plans), ids)
