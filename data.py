"""TRM puzzle datasets: the reference format via fsspec, deterministic multi-host batches, builders.

A dataset root (a local path or any fsspec URL such as ``gs://bucket/data/sudoku``) holds the
format of the reference implementation (SamsungSAILMontreal/TinyRecursiveModels):

    {root}/identifiers.json                 list: puzzle identifier -> name, 0 is "<blank>"
    {root}/{train,test}/dataset.json        Metadata below
    {root}/{train,test}/all__inputs.npy     integer [examples, seq_len] (uint8 in practice)
    {root}/{train,test}/all__labels.npy     integer [examples, seq_len]
    {root}/{train,test}/all__puzzle_identifiers.npy  int32 [puzzles]
    {root}/{train,test}/all__puzzle_indices.npy      int32 [puzzles + 1], example offsets
    {root}/{train,test}/all__group_indices.npy       int32 [groups + 1], puzzle offsets
    {root}/test_puzzles.json                ARC only: the raw test tasks, for the evaluator

A puzzle is one or more examples sharing a puzzle identifier; a group is a puzzle and its
augmentations.

Reading
    open_dataset(url, split, cache_dir=None) -> Dataset
    open_train_test(url, cache_dir=None) -> (Dataset, Dataset)   # also checks they agree
    read_identifiers(url) -> list[str]
    total_train_steps(metadata, epochs, global_batch_size) -> int
Remote arrays are copied once to ``cache_dir`` (default ``~/.cache/trm-data/<hash of url>``) and
memory-mapped; a local root is memory-mapped in place. Every problem raises DatasetError.
Files are read and written through storage.py (a failing write raises storage.StorageError).

Batches (dicts of numpy arrays: ``inputs`` and ``labels`` int32 [rows, seq_len], labels -100
where ignored, ``puzzle_identifiers`` int32 [rows]; rows = global_batch_size / process_count)
    TrainBatches(dataset, global_batch_size, seed, process_index=0, process_count=1)
        .batch(step) -> dict         this host's rows of global batch ``step``
        .global_plan(step) -> (example_indices, puzzle_indices) of the whole global batch
    EvalBatches(dataset, global_batch_size, process_index=0, process_count=1,
                max_examples=None, seed=0)
        len(), .batch(i) -> dict, .valid(i) -> bool [rows], .num_examples

Building (each writes the reference format to any fsspec URL)
    python data.py build-sudoku | build-maze | build-arc | build-demo --out URL ...
    (build-arc writes, byte for byte, what the reference's dataset/build_arc_dataset.py writes
    from the same files and options, seed 42 by default)
    python data.py info URL      metadata, sizes and a sample
    python data.py bench URL     TrainBatches rows per second from the local cache
    write_split(url, split, metadata, arrays), write_identifiers(url, names)
ARC helpers for the evaluator: arc_identifier, parse_arc_identifier, augment_arc_grid,
invert_arc_augmentation, encode_arc_pair, decode_arc_grid.

This module imports numpy, fsspec (through storage.py) and the standard library only (never
torch or torch_xla).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Optional, Sequence

import numpy as np

from storage import (StorageError, access_errors, filesystem, is_local, join_url, read_json, write_bytes,
                     write_file)

IGNORE_LABEL_ID = -100  # what labels equal to metadata.ignore_label_id become in batches
SET_NAME = "all"  # the only set name the reference builders write
SPLITS = ("train", "test")
ARRAY_NAMES = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")
DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "trm-data")


class DatasetError(ValueError):
    """A dataset cannot be read or built; the message names the path and what to do."""


# --------------------------------------------------------------------------------------------
# Metadata and reading
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Metadata:
    """The contents of a split's dataset.json (same fields as the reference)."""

    pad_id: int
    """Token that fills unused input positions."""
    ignore_label_id: Optional[int]
    """Label value that carries no loss (becomes -100 in batches); None if every label counts."""
    blank_identifier_id: int
    """Puzzle identifier of padding rows."""
    vocab_size: int
    """Number of token values, pad included."""
    seq_len: int
    """Tokens per example."""
    num_puzzle_identifiers: int
    """Rows of the puzzle-embedding table (identifiers are 0 .. num_puzzle_identifiers-1)."""
    total_groups: int
    """Number of groups (a puzzle and its augmentations)."""
    mean_puzzle_examples: float
    """Mean examples per puzzle; sets the number of training steps per epoch."""
    total_puzzles: int
    """Puzzles as recorded by the builder (the reference's Sudoku/Maze builders write the group
    count here, so readers do not rely on it)."""
    sets: tuple
    """Names of the array sets in the split; the reference always writes ("all",)."""

    @classmethod
    def from_dict(cls, data, url: str) -> "Metadata":
        if not isinstance(data, dict):
            raise DatasetError(f"{url} must hold a JSON object, found {type(data).__name__}; "
                               "rebuild the dataset.")
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise DatasetError(f"{url} lacks the field(s) {missing}; it is not a TRM dataset "
                               "description. Rebuild the dataset with `python data.py build-...`.")
        values = {}
        for f in fields(cls):
            value = data[f.name]
            if f.name == "sets":
                ok = isinstance(value, list) and len(value) > 0 \
                    and all(isinstance(s, str) for s in value)
                value = tuple(value) if ok else value
            elif f.name == "mean_puzzle_examples":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            elif f.name == "ignore_label_id":
                ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise DatasetError(f"{url}: field {f.name!r} has the invalid value {value!r}; "
                                   "rebuild the dataset.")
            values[f.name] = value
        if values["seq_len"] < 1 or values["vocab_size"] < 1 or values["total_groups"] < 1:
            raise DatasetError(f"{url}: seq_len, vocab_size and total_groups must be positive, "
                               f"found {values['seq_len']}, {values['vocab_size']}, "
                               f"{values['total_groups']}; rebuild the dataset.")
        return cls(**values)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["sets"] = list(self.sets)
        return data


@dataclass
class Dataset:
    """One split of a dataset: metadata plus arrays (inputs/labels memory-mapped)."""

    url: str
    """Root URL the split was opened from."""
    split: str
    """"train" or "test"."""
    metadata: Metadata
    """The split's dataset.json."""
    inputs: np.ndarray = field(repr=False)
    """[examples, seq_len] token ids, memory-mapped."""
    labels: np.ndarray = field(repr=False)
    """[examples, seq_len] target ids, memory-mapped."""
    puzzle_identifiers: np.ndarray = field(repr=False)
    """[puzzles] puzzle-embedding row of each puzzle."""
    puzzle_indices: np.ndarray = field(repr=False)
    """[puzzles + 1] first example of each puzzle (int64, in memory)."""
    group_indices: np.ndarray = field(repr=False)
    """[groups + 1] first puzzle of each group (int64, in memory)."""
    downloaded_bytes: int
    """Bytes copied from remote storage when opening (0 when cached or local)."""

    @property
    def num_examples(self) -> int:
        return len(self.inputs)

    @property
    def num_puzzles(self) -> int:
        return len(self.puzzle_indices) - 1

    @property
    def num_groups(self) -> int:
        return len(self.group_indices) - 1


def _default_cache_dir(url: str) -> str:
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(DEFAULT_CACHE_ROOT), digest)


def _version_tag(info: dict) -> str:
    """Short tag of a remote object's size and version, so a replaced object is fetched again."""
    stamp = next((str(info[k]) for k in ("generation", "etag", "ETag", "LastModified", "mtime")
                  if info.get(k) is not None), "")
    return hashlib.sha256(f"{info.get('size')}|{stamp}".encode()).hexdigest()[:12]


def _cached_copy(fs, remote_path: str, url: str, cache_split_dir: str) -> tuple[str, int]:
    """Local path of a complete copy of a remote file, and the bytes downloaded for it.

    Downloads go to a temporary file in the cache directory that is renamed into place once its
    size matches the remote size, so processes starting together never see a partial file.
    """
    with access_errors(url, DatasetError):
        info = fs.info(remote_path)
    remote_size = info.get("size")
    name = os.path.basename(remote_path)
    stem = name[:-len(".npy")] if name.endswith(".npy") else name
    local_path = os.path.join(cache_split_dir, f"{stem}.{_version_tag(info)}.npy")
    if os.path.exists(local_path) and os.path.getsize(local_path) == remote_size:
        return local_path, 0
    os.makedirs(cache_split_dir, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=cache_split_dir, prefix=f".{stem}.", suffix=".part")
    os.close(fd)
    start = time.time()
    try:
        with access_errors(url, DatasetError):
            fs.get_file(remote_path, tmp_path)
        size = os.path.getsize(tmp_path)
        if remote_size is not None and size != remote_size:
            raise DatasetError(f"Downloaded {size} bytes of {url} but the storage reports "
                               f"{remote_size}; the object changed during the download. Retry.")
        os.replace(tmp_path, local_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    print(f"data: copied {url} ({size / 1e6:.1f} MB, {time.time() - start:.1f} s) to {local_path}",
          file=sys.stderr, flush=True)
    # Older versions of the same array are no longer needed.
    for other in os.listdir(cache_split_dir):
        if other.startswith(stem + ".") and other.endswith(".npy") and \
                os.path.join(cache_split_dir, other) != local_path:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(cache_split_dir, other))
    return local_path, size


def _load_npy(local_path: str, url: str, memory_map: bool) -> np.ndarray:
    try:
        return np.load(local_path, mmap_mode="r" if memory_map else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DatasetError(f"{url} is not a readable .npy array ({exc}); rebuild or re-upload "
                           "it.") from exc


def _missing_split_error(url: str, split: str, json_url: str) -> DatasetError:
    """The most useful explanation for a missing dataset.json."""
    fs, root_path = filesystem(url)
    with access_errors(url, DatasetError):
        root_exists = fs.exists(root_path)
        split_exists = root_exists and fs.exists(join_url(root_path, split))
    if not root_exists:
        return DatasetError(f"Dataset root {url} does not exist. Check the URL, or build a "
                            "dataset there with `python data.py build-demo --out URL` "
                            "(or build-sudoku, build-maze, build-arc).")
    if not split_exists:
        return DatasetError(f"Dataset split {join_url(url, split)} is missing: a dataset root "
                            f"needs train/ and test/. Check that {url} is the root (the folder "
                            "that contains train/ and test/), or rebuild the dataset.")
    return DatasetError(f"{json_url} is missing: every split needs its dataset.json. The "
                        "upload may be incomplete; copy it again or rebuild the dataset.")


def read_metadata(url: str, split: str) -> Metadata:
    """The dataset.json of one split ("train" or "test") of the dataset rooted at ``url``."""
    if split not in SPLITS:
        raise DatasetError(f"Unknown split {split!r} for {url}; use one of {SPLITS}.")
    json_url = join_url(url, split, "dataset.json")
    try:
        metadata = Metadata.from_dict(read_json(json_url, "dataset", DatasetError), json_url)
    except FileNotFoundError:
        raise _missing_split_error(url, split, json_url) from None
    if len(metadata.sets) != 1:
        raise DatasetError(f"{json_url} lists the sets {list(metadata.sets)}; only datasets "
                           "with one set per split are supported. Rebuild with one set.")
    return metadata


def open_dataset(url: str, split: str, cache_dir: Optional[str] = None) -> Dataset:
    """Open one split ("train" or "test") of the dataset rooted at ``url``.

    A remote split's arrays are copied to ``cache_dir/<split>/`` once (default
    ``~/.cache/trm-data/<hash of url>``) and memory-mapped; a local root is read in place.
    """
    metadata = read_metadata(url, split)
    split_url = join_url(url, split)
    fs, split_path = filesystem(split_url)
    local = is_local(fs)
    cache_split_dir = os.path.join(cache_dir or _default_cache_dir(url), split)
    arrays, downloaded = {}, 0
    for name in ARRAY_NAMES:
        file_name = f"{metadata.sets[0]}__{name}.npy"
        array_url = join_url(split_url, file_name)
        array_path = join_url(split_path, file_name)
        try:
            if local:
                if not os.path.isfile(array_path):
                    raise FileNotFoundError(array_path)
                local_path = array_path
            else:
                local_path, size = _cached_copy(fs, array_path, array_url, cache_split_dir)
                downloaded += size
        except FileNotFoundError:
            raise DatasetError(f"{array_url} is missing; the dataset upload may be incomplete. "
                               "Copy it again or rebuild the dataset.") from None
        # The example arrays stay on disk; the index arrays are small and used on every batch.
        array = _load_npy(local_path, array_url, memory_map=name in ("inputs", "labels"))
        if array.dtype.kind not in "iu":
            raise DatasetError(f"{array_url} has dtype {array.dtype}, expected integers "
                               "(uint8 tokens, int32 indices). Rebuild the dataset.")
        arrays[name] = array
    _check_arrays(arrays, metadata, split_url)
    return Dataset(url=url, split=split, metadata=metadata,
                   inputs=arrays["inputs"], labels=arrays["labels"],
                   puzzle_identifiers=np.asarray(arrays["puzzle_identifiers"], dtype=np.int32),
                   puzzle_indices=np.asarray(arrays["puzzle_indices"], dtype=np.int64),
                   group_indices=np.asarray(arrays["group_indices"], dtype=np.int64),
                   downloaded_bytes=downloaded)


def _check_arrays(arrays: dict, metadata: Metadata, split_url: str) -> None:
    """Raise DatasetError unless the arrays have the shapes dataset.json and each other imply."""
    def fail(name, problem):
        raise DatasetError(f"{join_url(split_url, f'{metadata.sets[0]}__{name}.npy')} {problem}. "
                           "The dataset is inconsistent: rebuild or re-upload it.")

    inputs, labels = arrays["inputs"], arrays["labels"]
    if inputs.ndim != 2 or inputs.shape[1] != metadata.seq_len:
        fail("inputs", f"has shape {inputs.shape}, expected [examples, {metadata.seq_len}] "
                       "(seq_len of dataset.json)")
    if labels.shape != inputs.shape:
        fail("labels", f"has shape {labels.shape}, expected {inputs.shape} like the inputs")
    for name in ("puzzle_identifiers", "puzzle_indices", "group_indices"):
        if arrays[name].ndim != 1:
            fail(name, f"has shape {arrays[name].shape}, expected one dimension")
    puzzle_indices, group_indices = arrays["puzzle_indices"], arrays["group_indices"]
    num_puzzles = len(puzzle_indices) - 1
    if num_puzzles < 1 or puzzle_indices[0] != 0 or puzzle_indices[-1] != len(inputs) \
            or np.any(np.diff(puzzle_indices) <= 0):
        fail("puzzle_indices", f"must rise strictly from 0 to {len(inputs)} (the number of "
                               f"examples); it has length {len(puzzle_indices)} and ends at "
                               f"{puzzle_indices[-1] if len(puzzle_indices) else None}")
    if len(group_indices) != metadata.total_groups + 1 or group_indices[0] != 0 \
            or group_indices[-1] != num_puzzles or np.any(np.diff(group_indices) <= 0):
        fail("group_indices", f"must have length {metadata.total_groups + 1} (total_groups + 1) "
                              f"and rise strictly from 0 to {num_puzzles} (the number of "
                              f"puzzles); it has length {len(group_indices)}")
    identifiers = arrays["puzzle_identifiers"]
    if len(identifiers) != num_puzzles:
        fail("puzzle_identifiers", f"has length {len(identifiers)}, expected {num_puzzles} "
                                   "(one per puzzle)")
    if len(identifiers) and (identifiers.min() < 0
                             or identifiers.max() >= metadata.num_puzzle_identifiers):
        fail("puzzle_identifiers", f"holds values outside 0..{metadata.num_puzzle_identifiers - 1}"
                                   " (num_puzzle_identifiers of dataset.json)")


def open_train_test(url: str, cache_dir: Optional[str] = None) -> tuple[Dataset, Dataset]:
    """Open both splits and check that a model built for the train split can run the test split."""
    train = open_dataset(url, "train", cache_dir)
    test = open_dataset(url, "test", cache_dir)
    for name in ("seq_len", "vocab_size", "pad_id", "ignore_label_id"):
        train_value, test_value = getattr(train.metadata, name), getattr(test.metadata, name)
        if train_value != test_value:
            raise DatasetError(f"The splits of {url} disagree on {name}: train has {train_value}, "
                               f"test has {test_value}. Build both splits with the same builder "
                               "run.")
    if test.metadata.num_puzzle_identifiers > train.metadata.num_puzzle_identifiers:
        raise DatasetError(f"The test split of {url} uses {test.metadata.num_puzzle_identifiers} "
                           "puzzle identifiers but the train split (which sizes the embedding "
                           f"table) only {train.metadata.num_puzzle_identifiers}. Build both "
                           "splits with the same builder run.")
    return train, test


def read_identifiers(url: str) -> list:
    """identifiers.json of the dataset at ``url``: the name of each puzzle identifier."""
    json_url = join_url(url, "identifiers.json")
    try:
        names = read_json(json_url, "identifiers list", DatasetError)
    except FileNotFoundError:
        raise DatasetError(f"{json_url} is missing; rebuild the dataset.") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DatasetError(f"{json_url} must hold a list of names; rebuild the dataset.")
    return names


def identifiers_fingerprint(url: str) -> Optional[str]:
    """A short hash of the dataset's identifier names in order (identifiers.json), or None when
    it has none. Row i of a trained puzzle-embedding table belongs to identifier i: a model may
    only be evaluated or fine-tuned with its table on a dataset with the same fingerprint."""
    try:
        names = read_json(join_url(url, "identifiers.json"), "identifiers list", DatasetError)
    except FileNotFoundError:
        return None
    return hashlib.sha256(json.dumps(names, separators=(",", ":")).encode()).hexdigest()[:16]


def total_train_steps(metadata: Metadata, epochs: float, global_batch_size: int) -> int:
    """Optimizer steps of a run of ``epochs`` epochs, counted as the reference counts them."""
    return int(epochs * metadata.total_groups * metadata.mean_puzzle_examples / global_batch_size)


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

def _host_rows(global_batch_size: int, process_index: int, process_count: int) -> slice:
    """The contiguous rows of a global batch that host ``process_index`` materialises."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DatasetError(f"process_index {process_index} must lie in 0..{process_count - 1} "
                           f"(process_count {process_count}).")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise DatasetError(f"global_batch_size {global_batch_size} must be a positive multiple "
                           f"of process_count {process_count}: every host takes an equal share.")
    rows = global_batch_size // process_count
    return slice(process_index * rows, (process_index + 1) * rows)


def _collate(dataset: Dataset, examples: np.ndarray, puzzles: np.ndarray) -> dict:
    """The model's batch dict for the given example and puzzle indices (read from the memmaps)."""
    labels = dataset.labels[examples].astype(np.int32)
    if dataset.metadata.ignore_label_id is not None:
        labels[labels == dataset.metadata.ignore_label_id] = IGNORE_LABEL_ID
    return {"inputs": dataset.inputs[examples].astype(np.int32),
            "labels": labels,
            "puzzle_identifiers": dataset.puzzle_identifiers[puzzles]}


class _EpochPlan:
    """The random choices of one epoch: group order, one puzzle per group, example order.

    The epoch draws every group once, in a random order; each draw is one random puzzle of the
    group and owns that puzzle's examples (its "slots") in a random order.
    """

    def __init__(self, seed: int, epoch: int, dataset: Dataset, puzzle_sizes: np.ndarray):
        self._rng = np.random.default_rng([seed, epoch])
        order = self._rng.permutation(dataset.num_groups)
        starts, ends = dataset.group_indices[:-1], dataset.group_indices[1:]
        self.puzzles = self._rng.integers(starts[order], ends[order])
        # slot_ends[d] = first slot of draw d; slot_ends[-1] = number of slots in the epoch.
        self.slot_ends = np.concatenate(([0], np.cumsum(puzzle_sizes[self.puzzles])))
        self._puzzle_starts = dataset.puzzle_indices[self.puzzles]
        self._slot_examples = None
        self._slot_puzzles = None

    def slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(example index, puzzle index) of every slot of the epoch, in draw order."""
        if self._slot_examples is None:
            sizes = np.diff(self.slot_ends)
            draw_of_slot = np.repeat(np.arange(len(sizes)), sizes)
            # Shuffle each draw's examples: sort slots by (draw, random key).
            keys = self._rng.random(len(draw_of_slot))
            shuffled = np.lexsort((keys, draw_of_slot))
            self._slot_examples = (self._puzzle_starts[draw_of_slot]
                                   + shuffled - self.slot_ends[draw_of_slot])
            self._slot_puzzles = self.puzzles[draw_of_slot]
        return self._slot_examples, self._slot_puzzles


class TrainBatches:
    """Training batches with the reference's sampling, identical on every host.

    The epochs form one endless stream of draws (epoch e draws every group once, shuffled by a
    generator seeded with (seed, e)). A global batch takes consecutive draws, each contributing
    its puzzle's examples in random order, until it holds ``global_batch_size`` rows; the draw
    that overflows is cut short and its remaining examples are skipped, as in the reference.
    The reference drops the partial batch at the end of every block of epochs between
    evaluations; here the stream has no end, so no batch is partial.

    The global batch of ``step`` is a pure function of (seed, step): a resumed run only needs
    the step. Host ``process_index`` of ``process_count`` gets rows
    [p*B/P, (p+1)*B/P) of it and reads only those rows.
    """

    _BOUNDARY_STRIDE = 256  # remember where every 256th batch starts, for random access

    def __init__(self, dataset: Dataset, global_batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.rows = _host_rows(global_batch_size, process_index, process_count)
        if seed < 0:
            raise DatasetError(f"seed {seed} must be non-negative.")
        self._puzzle_sizes = np.diff(dataset.puzzle_indices)
        self._num_groups = dataset.num_groups
        # When every puzzle has n examples each batch takes ceil(B/n) draws, so batch
        # boundaries are known without replaying earlier epochs.
        sizes = np.unique(self._puzzle_sizes)
        self._draws_per_batch = -(-global_batch_size // int(sizes[0])) if len(sizes) == 1 else None
        self._stride_starts = [0]  # first draw of batch k * _BOUNDARY_STRIDE
        self._last_start = (0, 0)  # (step, first draw) of the batch asked for last
        self._plans: dict[int, _EpochPlan] = {}

    def _plan(self, epoch: int) -> _EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:
            if len(self._plans) >= 4:
                del self._plans[min(self._plans)]
            plan = self._plans[epoch] = _EpochPlan(self.seed, epoch, self.dataset,
                                                   self._puzzle_sizes)
        return plan

    def _walk(self, first_draw: int) -> tuple[list, int]:
        """The slot ranges [(epoch, lo, hi)] of the batch starting at ``first_draw``, and the
        first draw of the next batch."""
        ranges, need = [], self.global_batch_size
        epoch, draw = divmod(first_draw, self._num_groups)
        while True:
            slot_ends = self._plan(epoch).slot_ends
            lo = int(slot_ends[draw])
            if slot_ends[-1] - lo >= need:
                ranges.append((epoch, lo, lo + need))
                # The draw holding the batch's last row is finished (cut short if needed).
                next_draw = int(np.searchsorted(slot_ends, lo + need, side="left"))
                return ranges, epoch * self._num_groups + next_draw
            ranges.append((epoch, lo, int(slot_ends[-1])))
            need -= int(slot_ends[-1]) - lo
            epoch, draw = epoch + 1, 0

    def _first_draw(self, step: int) -> int:
        if step < 0:
            raise DatasetError(f"step {step} must be non-negative.")
        if self._draws_per_batch is not None:
            return step * self._draws_per_batch
        # Puzzle sizes differ: replay batch boundaries from the nearest one known.
        stride = self._BOUNDARY_STRIDE
        known = min(step // stride, len(self._stride_starts) - 1)
        k, draw = known * stride, self._stride_starts[known]
        if k <= self._last_start[0] <= step:
            k, draw = self._last_start
        while k < step:
            draw = self._walk(draw)[1]
            k += 1
            if k % stride == 0 and k // stride == len(self._stride_starts):
                self._stride_starts.append(draw)
        self._last_start = (step, draw)
        return draw

    def global_plan(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(example index, puzzle index) of every row of global batch ``step``."""
        ranges, _ = self._walk(self._first_draw(step))
        examples, puzzles = [], []
        for epoch, lo, hi in ranges:
            slot_examples, slot_puzzles = self._plan(epoch).slots()
            examples.append(slot_examples[lo:hi])
            puzzles.append(slot_puzzles[lo:hi])
        return np.concatenate(examples), np.concatenate(puzzles)

    def batch(self, step: int) -> dict:
        """This host's rows of global batch ``step``."""
        examples, puzzles = self.global_plan(step)
        return _collate(self.dataset, examples[self.rows], puzzles[self.rows])


class EvalBatches:
    """All test examples in order (or a fixed seeded subset), split across hosts like training.

    The last global batch is padded with rows whose labels are all -100, whose inputs are
    pad_id and whose puzzle identifier is blank_identifier_id; ``valid(i)`` marks real rows.
    """

    def __init__(self, dataset: Dataset, global_batch_size: int, process_index: int = 0,
                 process_count: int = 1, max_examples: Optional[int] = None, seed: int = 0):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.rows = _host_rows(global_batch_size, process_index, process_count)
        total = dataset.num_examples
        if max_examples is not None and max_examples < 1:
            raise DatasetError(f"max_examples {max_examples} must be positive (or None for all).")
        if max_examples is None or max_examples >= total:
            self.examples = np.arange(total)
        else:
            # A fixed subset, kept in dataset order so puzzles stay together.
            chosen = np.random.default_rng(seed).choice(total, size=max_examples, replace=False)
            self.examples = np.sort(chosen)
        self.puzzles = np.searchsorted(dataset.puzzle_indices, self.examples, side="right") - 1

    @property
    def num_examples(self) -> int:
        """Real (unpadded) examples over all batches."""
        return len(self.examples)

    def __len__(self) -> int:
        return -(-len(self.examples) // self.global_batch_size)

    def _positions(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"evaluation batch {index} out of range 0..{len(self) - 1}")
        return index * self.global_batch_size + np.arange(self.global_batch_size)[self.rows]

    def valid(self, index: int) -> np.ndarray:
        """Bool [rows]: which of this host's rows of batch ``index`` are real examples."""
        return self._positions(index) < len(self.examples)

    def batch(self, index: int) -> dict:
        """This host's rows of evaluation batch ``index``, padded past the last example."""
        positions = self._positions(index)
        real = positions[positions < len(self.examples)]
        batch = _collate(self.dataset, self.examples[real], self.puzzles[real])
        padding = len(positions) - len(real)
        if padding:
            metadata = self.dataset.metadata
            pad_values = {"inputs": metadata.pad_id, "labels": IGNORE_LABEL_ID,
                          "puzzle_identifiers": metadata.blank_identifier_id}
            batch = {key: np.concatenate([value, np.full((padding,) + value.shape[1:],
                                                         pad_values[key], np.int32)])
                     for key, value in batch.items()}
        return batch


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

def write_split(url: str, split: str, metadata: Metadata, arrays: dict) -> None:
    """Write one split of the reference format under the dataset root ``url``.

    ``arrays`` maps each of ARRAY_NAMES to an array (a memmap is fine: it is streamed).
    dataset.json is written last, so a reader never finds a split with missing arrays.
    """
    split_url = join_url(url, split)
    arrays = {name: np.asarray(arrays[name]) if name not in ("inputs", "labels") else arrays[name]
              for name in ARRAY_NAMES}
    for name in ("puzzle_identifiers", "puzzle_indices", "group_indices"):
        arrays[name] = arrays[name].astype(np.int32)
    _check_arrays(arrays, metadata, split_url)
    for name in ARRAY_NAMES:
        write_file(join_url(split_url, f"{metadata.sets[0]}__{name}.npy"),
                   lambda f, array=arrays[name]: np.save(f, array))
    write_bytes(join_url(split_url, "dataset.json"), json.dumps(metadata.to_dict()).encode())


def write_identifiers(url: str, names: Sequence[str]) -> None:
    """Write identifiers.json (identifier -> name; entry 0 is "<blank>") at the root ``url``."""
    write_bytes(join_url(url, "identifiers.json"), json.dumps(list(names)).encode())


class _SplitAccumulator:
    """Collects one split group by group; example rows go to local temporary files, so a
    large dataset (ARC with 1000 augmentations is several GB) never sits in memory."""

    def __init__(self, seq_len: int, workdir: str, split: str):
        self.seq_len = seq_len
        self._paths = {name: os.path.join(workdir, f"{split}_{name}.bin")
                       for name in ("inputs", "labels")}
        self._files = {name: open(path, "wb") for name, path in self._paths.items()}
        self._puzzle_sizes: list = []
        self._identifiers: list = []
        self._group_sizes: list = []

    def add_group(self, inputs: np.ndarray, labels: np.ndarray, puzzle_sizes: Sequence[int],
                  identifiers: Sequence[int]) -> None:
        """Append a group: ``inputs``/``labels`` [examples, seq_len] of its puzzles, one after
        another, with each puzzle's number of examples and identifier."""
        assert inputs.shape == labels.shape and inputs.shape[1] == self.seq_len
        assert sum(puzzle_sizes) == len(inputs) and len(puzzle_sizes) == len(identifiers)
        self._files["inputs"].write(np.ascontiguousarray(inputs, dtype=np.uint8).tobytes())
        self._files["labels"].write(np.ascontiguousarray(labels, dtype=np.uint8).tobytes())
        self._puzzle_sizes.extend(int(n) for n in puzzle_sizes)
        self._identifiers.extend(int(i) for i in identifiers)
        self._group_sizes.append(len(puzzle_sizes))

    def write(self, url: str, split: str, vocab_size: int, num_puzzle_identifiers: int) -> Metadata:
        """Write the collected split to ``url`` and return its metadata."""
        for f in self._files.values():
            f.close()
        if not self._group_sizes:
            raise DatasetError(f"The {split} split for {url} would be empty; check the source "
                               "data and the filters (subsample size, minimum difficulty).")
        num_examples = sum(self._puzzle_sizes)
        rows = {name: np.memmap(path, dtype=np.uint8, mode="r",
                                shape=(num_examples, self.seq_len))
                for name, path in self._paths.items()}
        metadata = Metadata(
            pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=vocab_size,
            seq_len=self.seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
            total_groups=len(self._group_sizes),
            mean_puzzle_examples=num_examples / len(self._puzzle_sizes),
            total_puzzles=len(self._puzzle_sizes), sets=(SET_NAME,))
        write_split(url, split, metadata, {
            "inputs": rows["inputs"], "labels": rows["labels"],
            "puzzle_identifiers": np.array(self._identifiers, dtype=np.int32),
            "puzzle_indices": np.concatenate(([0], np.cumsum(self._puzzle_sizes))),
            "group_indices": np.concatenate(([0], np.cumsum(self._group_sizes)))})
        return metadata


# --------------------------------------------------------------------------------------------
# Sudoku and Maze builders
# --------------------------------------------------------------------------------------------

# The public copies of the sources (the sapientinc datasets on Hugging Face).
_HF = "https://huggingface.co/datasets/sapientinc"
SUDOKU_CSV_URL = _HF + "/sudoku-extreme/resolve/main/{split}.csv"
MAZE_CSV_URL = _HF + "/maze-30x30-hard-1k/resolve/main/{split}.csv"
MAZE_CHARSET = "# SGo"  # wall, open, start, goal, path -> tokens 1..5 (0 is pad)


def read_puzzle_csv(url: str, min_difficulty: Optional[int] = None) -> tuple[list, list]:
    """(questions, answers) strings of a CSV with the columns source,question,answer,rating,
    keeping rows rated at least ``min_difficulty``."""
    fs, path = filesystem(url)
    questions, answers = [], []
    try:
        with access_errors(url, DatasetError), fs.open(path, "rt", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or [h.strip().lower() for h in header[:4]] != \
                    ["source", "question", "answer", "rating"]:
                raise DatasetError(f"{url} must be a CSV with the header "
                                   f"source,question,answer,rating; found {header}.")
            for line, row in enumerate(reader, start=2):
                if len(row) < 4:
                    raise DatasetError(f"{url} line {line} has {len(row)} columns, expected 4.")
                _source, question, answer, rating = row[:4]
                if len(question) != len(answer):
                    raise DatasetError(f"{url} line {line}: question and answer differ in "
                                       "length.")
                if min_difficulty is None or int(rating) >= min_difficulty:
                    questions.append(question)
                    answers.append(answer)
    except FileNotFoundError:
        raise DatasetError(f"Source CSV {url} not found; pass a local file or a reachable "
                           "URL.") from None
    return questions, answers


def _subsample(rng: np.random.Generator, items: list, size: Optional[int]) -> list:
    if size is None or size >= len(items):
        return items
    return [items[i] for i in rng.choice(len(items), size=size, replace=False)]


def shuffle_sudoku(puzzle: np.ndarray, solution: np.ndarray, rng: np.random.Generator,
                   count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` validity-preserving variants of a Sudoku (flat n*n digits, 0 = blank, n = box²):
    a digit permutation, an optional transpose, and shuffles of bands, rows within bands,
    stacks and columns within stacks. Returns (puzzles, solutions), each [count, n*n]."""
    n = math.isqrt(len(puzzle))
    box = math.isqrt(n)
    assert box * box == n and n * n == len(puzzle)
    digit_maps = np.concatenate([np.zeros((count, 1), np.int64),
                                 np.argsort(rng.random((count, n)), axis=1) + 1], axis=1)
    transpose = rng.random(count) < 0.5

    def line_permutations():
        # Shuffle the bands (blocks of `box` lines) and the lines inside each band.
        bands = np.argsort(rng.random((count, box)), axis=1)
        within = np.argsort(rng.random((count, box, box)), axis=2)
        return (bands[:, :, None] * box + within).reshape(count, n)

    rows, cols = line_permutations(), line_permutations()
    variants = []
    for grid in (puzzle, solution):
        grid = grid.reshape(n, n)
        grids = np.where(transpose[:, None, None], grid.T[None], grid[None])
        grids = grids[np.arange(count)[:, None, None], rows[:, :, None], cols[:, None, :]]
        variants.append(np.take_along_axis(digit_maps, grids.reshape(count, -1), axis=1))
    return variants[0].astype(np.uint8), variants[1].astype(np.uint8)


def _digit_grids(strings: list, url: str, length: int) -> np.ndarray:
    """[len(strings), length] digits of Sudoku strings ('.' or '0' = blank)."""
    if any(len(s) != length for s in strings):
        raise DatasetError(f"{url}: every question and answer must have {length} characters.")
    flat = np.frombuffer("".join(strings).replace(".", "0").encode(), dtype=np.uint8)
    if np.any((flat < ord("0")) | (flat > ord("9"))):
        raise DatasetError(f"{url}: Sudoku cells must be digits or '.'.")
    return (flat - ord("0")).reshape(len(strings), length)


def build_sudoku(out: str, train_csv: str = SUDOKU_CSV_URL.format(split="train"),
                 test_csv: str = SUDOKU_CSV_URL.format(split="test"),
                 subsample_size: Optional[int] = None, min_difficulty: Optional[int] = None,
                 num_aug: int = 0, seed: int = 0) -> None:
    """Sudoku-Extreme in the reference format: tokens digit+1 (1 = blank), vocab 11, seq 81.

    Train: optionally ``subsample_size`` random puzzles, each a group of itself plus ``num_aug``
    shuffled variants. Test: every puzzle, unaugmented. ``min_difficulty`` filters both.
    """
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as workdir:
        for split, csv_url in (("train", train_csv), ("test", test_csv)):
            pairs = list(zip(*read_puzzle_csv(csv_url, min_difficulty)))
            if split == "train":
                pairs = _subsample(rng, pairs, subsample_size)
            puzzles = _digit_grids([q for q, _ in pairs], csv_url, 81)
            solutions = _digit_grids([a for _, a in pairs], csv_url, 81)
            augmentations = num_aug if split == "train" else 0
            accumulator = _SplitAccumulator(81, workdir, split)
            for puzzle, solution in zip(puzzles, solutions):
                inputs, labels = puzzle[None], solution[None]
                if augmentations:
                    more_inputs, more_labels = shuffle_sudoku(puzzle, solution, rng, augmentations)
                    inputs = np.concatenate([inputs, more_inputs])
                    labels = np.concatenate([labels, more_labels])
                accumulator.add_group(inputs + 1, labels + 1, [1] * len(inputs), [0] * len(inputs))
            accumulator.write(out, split, vocab_size=11, num_puzzle_identifiers=1)
    write_identifiers(out, ["<blank>"])


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


def build_maze(out: str, train_csv: str = MAZE_CSV_URL.format(split="train"),
               test_csv: str = MAZE_CSV_URL.format(split="test"),
               subsample_size: Optional[int] = None, min_difficulty: Optional[int] = None,
               aug: bool = False, seed: int = 0) -> None:
    """Maze-Hard in the reference format: characters "# SGo" -> tokens 1..5, vocab 6,
    seq = grid cells. With ``aug`` each train maze is a group of its 8 dihedral variants."""
    rng = np.random.default_rng(seed)
    char_to_token = np.zeros(256, np.uint8)
    char_to_token[[ord(c) for c in MAZE_CHARSET]] = np.arange(1, len(MAZE_CHARSET) + 1)
    with tempfile.TemporaryDirectory() as workdir:
        seq_len = None
        for split, csv_url in (("train", train_csv), ("test", test_csv)):
            pairs = list(zip(*read_puzzle_csv(csv_url, min_difficulty)))
            if split == "train":
                pairs = _subsample(rng, pairs, subsample_size)
            if not pairs:
                raise DatasetError(f"{csv_url} has no mazes left after filtering.")
            side = math.isqrt(len(pairs[0][0]))
            if seq_len is None:
                seq_len = side * side
            accumulator = _SplitAccumulator(seq_len, workdir, split)
            for question, answer in pairs:
                if len(question) != seq_len or set(question + answer) - set(MAZE_CHARSET):
                    raise DatasetError(f"{csv_url}: every maze must be a {side}x{side} grid of "
                                       f"the characters {MAZE_CHARSET!r}.")
                grids = [char_to_token[np.frombuffer(s.encode(), np.uint8)].reshape(side, side)
                         for s in (question, answer)]
                transforms = range(8) if (aug and split == "train") else range(1)
                inputs = np.stack([dihedral_transform(grids[0], t).ravel() for t in transforms])
                labels = np.stack([dihedral_transform(grids[1], t).ravel() for t in transforms])
                accumulator.add_group(inputs, labels, [1] * len(inputs), [0] * len(inputs))
            accumulator.write(out, split, vocab_size=len(MAZE_CHARSET) + 1,
                              num_puzzle_identifiers=1)
    write_identifiers(out, ["<blank>"])


# --------------------------------------------------------------------------------------------
# ARC
# --------------------------------------------------------------------------------------------

ARC_GRID_SIZE = 30  # grids are placed on a 30x30 canvas: seq_len 900
ARC_ID_SEPARATOR = "|||"  # identifier of an augmented task: "task|||t<transform>|||<colour map>"
ARC_AUGMENT_RETRIES = 5  # tries per wanted augmentation before giving up on duplicates
ARC_PAD, ARC_EOS, ARC_FIRST_COLOUR = 0, 1, 2  # tokens: pad, end of grid, colours 0..9 -> 2..11
ARC_SEED = 42  # the reference builder's default: with it, its checkpoints' embeddings line up


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


def load_arc_tasks(challenges_url: str, solutions_url: Optional[str]) -> dict:
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
            accumulator = _SplitAccumulator(ARC_GRID_SIZE ** 2, workdir, split)
            for task in tasks:
                if split in task.splits:
                    _add_arc_group(accumulator, task.pairs[split], task.plans,
                                   [identifier_ids[i] for i in task.identifiers],
                                   shift=split == "train", rng=rng)
            accumulator.write(out, split, vocab_size=ARC_FIRST_COLOUR + 10,
                              num_puzzle_identifiers=len(identifier_ids) + 1)
    write_identifiers(out, ["<blank>"] + list(identifier_ids))
    write_bytes(join_url(out, "test_puzzles.json"), json.dumps(test_tasks).encode())


def _add_arc_group(accumulator: _SplitAccumulator, pairs: list, plans: np.ndarray, ids: list,
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


# --------------------------------------------------------------------------------------------
# Demo: 4x4 Sudoku, generated locally
# --------------------------------------------------------------------------------------------

def all_sudoku_4x4() -> np.ndarray:
    """Every solved 4x4 Sudoku (2x2 boxes) as [288, 16] digits 1..4."""
    lines = np.array(list(itertools.permutations(range(1, 5))), np.uint8)
    grids = lines[:, None, :]  # [candidates, rows so far, 4]
    for row in range(1, 4):
        extended = np.concatenate([np.repeat(grids, len(lines), axis=0),
                                   np.tile(lines, (len(grids), 1))[:, None, :]], axis=1)
        columns_ok = np.all(extended[:, :row, :] != extended[:, row:row + 1, :], axis=(1, 2))
        if row % 2 == 1:  # second row of a band: the band's boxes must hold 1..4
            box_rows = extended[:, row - 1:row + 1, :].reshape(-1, 2, 2, 2).transpose(0, 2, 1, 3)
            box_ok = np.all(np.sort(box_rows.reshape(-1, 2, 4), axis=2) == [1, 2, 3, 4],
                            axis=(1, 2))
            columns_ok &= box_ok
        grids = extended[columns_ok]
    return grids.reshape(len(grids), 16)


def _unique_4x4_puzzle(solution: np.ndarray, blanks: int, rng: np.random.Generator,
                       solutions: np.ndarray) -> np.ndarray:
    """``solution`` with up to ``blanks`` cells emptied (0), keeping ``solution`` the only
    completion."""
    puzzle = solution.copy()
    for cell in rng.permutation(16):
        if np.sum(puzzle == 0) >= blanks:
            break
        trial = puzzle.copy()
        trial[cell] = 0
        givens = trial > 0
        if np.sum(np.all(solutions[:, givens] == trial[givens], axis=1)) == 1:
            puzzle = trial
    return puzzle


def build_demo(out: str, train_puzzles: int = 300, num_aug: int = 15, test_puzzles: int = 300,
               min_blanks: int = 4, max_blanks: int = 10, seed: int = 0) -> None:
    """4x4 Sudoku with a unique solution, in the Sudoku format (tokens digit+1, 1 = blank,
    vocab 6, seq 16): ``train_puzzles`` groups of a puzzle and ``num_aug`` shuffled variants,
    and ``test_puzzles`` further puzzles that appear nowhere in train. Small enough for a tiny
    TRM to learn on a laptop CPU."""
    if not 1 <= min_blanks <= max_blanks <= 12:
        raise DatasetError(f"Need 1 <= min_blanks ({min_blanks}) <= max_blanks ({max_blanks}) "
                           "<= 12 (a 4x4 Sudoku needs at least 4 givens).")
    rng = np.random.default_rng(seed)
    solutions = all_sudoku_4x4()

    def random_puzzle():
        solution = solutions[rng.integers(len(solutions))]
        blanks = int(rng.integers(min_blanks, max_blanks + 1))
        return _unique_4x4_puzzle(solution, blanks, rng, solutions), solution

    seen = set()
    with tempfile.TemporaryDirectory() as workdir:
        train = _SplitAccumulator(16, workdir, "train")
        for _ in range(train_puzzles):
            puzzle, solution = random_puzzle()
            inputs, labels = puzzle[None], solution[None]
            if num_aug:
                more_inputs, more_labels = shuffle_sudoku(puzzle, solution, rng, num_aug)
                inputs = np.concatenate([inputs, more_inputs])
                labels = np.concatenate([labels, more_labels])
            seen.update(row.tobytes() for row in inputs)
            train.add_group(inputs + 1, labels + 1, [1] * len(inputs), [0] * len(inputs))
        test = _SplitAccumulator(16, workdir, "test")
        made = 0
        for _ in range(100 * test_puzzles):
            if made == test_puzzles:
                break
            puzzle, solution = random_puzzle()
            if puzzle.tobytes() in seen:
                continue
            seen.add(puzzle.tobytes())
            test.add_group(puzzle[None] + 1, solution[None] + 1, [1], [0])
            made += 1
        for split, accumulator in (("train", train), ("test", test)):
            accumulator.write(out, split, vocab_size=6, num_puzzle_identifiers=1)
    write_identifiers(out, ["<blank>"])


# --------------------------------------------------------------------------------------------
# info, bench and the command line
# --------------------------------------------------------------------------------------------

def _npy_header(fs, path: str) -> tuple[tuple, np.dtype, int]:
    """(shape, dtype, data offset) of a .npy file, reading only its header."""
    with fs.open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _fortran_order, dtype = read_header(f)
        return shape, dtype, f.tell()


def _format_sequence(tokens: np.ndarray) -> str:
    """Tokens as a square grid when the length is a square, else one line."""
    width = len(str(int(tokens.max()))) if len(tokens) else 1
    side = math.isqrt(len(tokens))
    cells = [str(int(t)).rjust(width) for t in tokens]
    if side * side != len(tokens):
        return " ".join(cells)
    return "\n".join("    " + " ".join(cells[r * side:(r + 1) * side]) for r in range(side))


def info(url: str) -> None:
    """Print each split's metadata, array sizes and first example, reading only headers and one
    row (nothing is cached)."""
    print(f"dataset {url}")
    try:
        names = read_identifiers(url)
        print(f"identifiers.json: {len(names)} names, e.g. {names[:3]}")
    except DatasetError as exc:
        print(f"identifiers.json: unavailable ({exc})")
    for split in SPLITS:
        json_url = join_url(url, split, "dataset.json")
        try:
            metadata = Metadata.from_dict(read_json(json_url, "dataset", DatasetError), json_url)
        except FileNotFoundError:
            raise _missing_split_error(url, split, json_url) from None
        print(f"\n[{split}] {json.dumps(metadata.to_dict())}")
        fs, split_path = filesystem(join_url(url, split))
        headers = {}
        for name in ARRAY_NAMES:
            path = join_url(split_path, f"{metadata.sets[0]}__{name}.npy")
            with access_errors(url, DatasetError):
                if not fs.exists(path):
                    print(f"  {name:20s} MISSING")
                    continue
                headers[name] = _npy_header(fs, path)
            shape, dtype, _ = headers[name]
            print(f"  {name:20s} {str(dtype):6s} {str(shape):18s} "
                  f"{math.prod(shape) * dtype.itemsize / 1e6:10.2f} MB")
        if "inputs" in headers and "labels" in headers and headers["inputs"][0][0] > 0:
            print("  example 0, input:")
            for name in ("inputs", "labels"):
                shape, dtype, offset = headers[name]
                with fs.open(join_url(split_path, f"{metadata.sets[0]}__{name}.npy"), "rb") as f:
                    f.seek(offset)
                    row = np.frombuffer(f.read(shape[1] * dtype.itemsize), dtype=dtype)
                if name == "labels":
                    print("  label:")
                print(_format_sequence(row))


def bench(url: str, global_batch_size: int = 768, steps: int = 200, process_count: int = 1,
          cache_dir: Optional[str] = None) -> float:
    """Rows per second that one host gets from TrainBatches (after the dataset is cached)."""
    dataset = open_dataset(url, "train", cache_dir)
    batches = TrainBatches(dataset, global_batch_size, seed=0, process_index=0,
                           process_count=process_count)
    batches.batch(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batches.batch(step)
    elapsed = time.perf_counter() - start
    rows_per_second = steps * len(range(*batches.rows.indices(global_batch_size))) / elapsed
    print(f"{url}: {rows_per_second:,.0f} rows/s per host ({steps} steps, global batch "
          f"{global_batch_size}, {process_count} host(s), seq_len {dataset.metadata.seq_len})")
    return rows_per_second


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="data.py", description="Build, inspect and benchmark TRM puzzle datasets "
        "(local paths or fsspec URLs such as gs://bucket/path).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help_text, seed=0):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name.startswith("build-"):
            sub.add_argument("--out", required=True, help="dataset root URL to write")
            sub.add_argument("--seed", type=int, default=seed, help=f"random seed (default {seed})")
        return sub

    def csv_options(sub, default_url):
        sub.add_argument("--train-csv", default=default_url.format(split="train"),
                         help="train CSV (local file or URL; default: the public copy)")
        sub.add_argument("--test-csv", default=default_url.format(split="test"),
                         help="test CSV (local file or URL; default: the public copy)")
        sub.add_argument("--subsample-size", type=int, default=None,
                         help="keep this many random train puzzles")
        sub.add_argument("--min-difficulty", type=int, default=None,
                         help="keep puzzles rated at least this")

    sub = command("build-sudoku", "Build Sudoku-Extreme from its CSV files.")
    csv_options(sub, SUDOKU_CSV_URL)
    sub.add_argument("--num-aug", type=int, default=0, help="shuffled variants per train puzzle")
    sub = command("build-maze", "Build Maze-Hard from its CSV files.")
    csv_options(sub, MAZE_CSV_URL)
    sub.add_argument("--aug", action="store_true",
                     help="add the 8 dihedral variants of each train maze")
    sub = command("build-arc", "Build ARC-AGI from challenge/solution JSON files; with the "
                  "same files and options the output equals the reference builder's.",
                  seed=ARC_SEED)
    sub.add_argument("--input-prefix", required=True,
                     help="files are {prefix}_{subset}_challenges.json and _solutions.json")
    sub.add_argument("--subsets", nargs="+", default=["training", "evaluation", "concept"])
    sub.add_argument("--test-sets", nargs="+", default=["evaluation"],
                     help="subsets whose test pairs form the test split")
    sub.add_argument("--num-aug", type=int, default=1000, help="augmentations per task")
    sub = command("build-demo", "Build a small 4x4 Sudoku dataset locally (no download).")
    sub.add_argument("--train-puzzles", type=int, default=300)
    sub.add_argument("--num-aug", type=int, default=15)
    sub.add_argument("--test-puzzles", type=int, default=300)
    sub.add_argument("--min-blanks", type=int, default=4)
    sub.add_argument("--max-blanks", type=int, default=10)
    sub = command("info", "Print a dataset's metadata, array sizes and first example.")
    sub.add_argument("url")
    sub = command("bench", "Measure training-batch rows per second on one host.")
    sub.add_argument("url")
    sub.add_argument("--global-batch-size", type=int, default=768)
    sub.add_argument("--steps", type=int, default=200)
    sub.add_argument("--process-count", type=int, default=1)
    sub.add_argument("--cache-dir", default=None)

    args = parser.parse_args(argv)
    try:
        if args.command == "build-sudoku":
            build_sudoku(args.out, args.train_csv, args.test_csv, args.subsample_size,
                         args.min_difficulty, args.num_aug, args.seed)
        elif args.command == "build-maze":
            build_maze(args.out, args.train_csv, args.test_csv, args.subsample_size,
                       args.min_difficulty, args.aug, args.seed)
        elif args.command == "build-arc":
            build_arc(args.out, args.input_prefix, args.subsets, args.test_sets, args.num_aug,
                      args.seed)
        elif args.command == "build-demo":
            build_demo(args.out, args.train_puzzles, args.num_aug, args.test_puzzles,
                       args.min_blanks, args.max_blanks, args.seed)
        elif args.command == "info":
            info(args.url)
        elif args.command == "bench":
            bench(args.url, args.global_batch_size, args.steps, args.process_count,
                  args.cache_dir)
    except (DatasetError, StorageError) as exc:
        sys.exit(f"error: {exc}")
    if args.command.startswith("build-"):
        info(args.out)


if __name__ == "__main__":
    main()
