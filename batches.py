"""The batches of a run, a pure function of (seed, step): which examples make global batch s and
which of its rows each host reads, the evaluation's batches in order, and the prefetching that
uploads the next batch while a step runs. nanochat-style, the dataset format and its cache
live apart (data.py); this file only plans and reads batches from an open `data.Dataset`.

    TrainBatches(dataset, global_batch_size, seed, process_index=0, process_count=1)
        .batch(step) -> dict         this host's rows of global batch ``step``
        .global_plan(step) -> (example_indices, puzzle_indices) of the whole global batch
    EvalBatches(dataset, global_batch_size, process_index=0, process_count=1,
                max_examples=None, seed=0)
        len(), .batch(i) -> dict, .valid(i) -> bool [rows], .num_examples
    total_train_steps(metadata, epochs, global_batch_size) -> int
    train_rows_per_second(dataset, global_batch_size, ...) -> float   # TrainBatches' speed
    PrefetchedBatches(load, first_step, last_step).get(step)          # the loop's batches

A batch is a dict of numpy arrays: ``inputs`` and ``labels`` int32 [rows, seq_len], labels -100
where ignored, ``puzzle_identifiers`` int32 [rows]; rows = global_batch_size / process_count.
This module imports numpy and the standard library only (never torch or torch_xla).
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from data import IGNORE_LABEL_ID, Dataset, DatasetError, Metadata


def total_train_steps(metadata: Metadata, epochs: float, global_batch_size: int) -> int:
    """Optimizer steps of a run of ``epochs`` epochs, counted as the reference counts them."""
    return int(epochs * metadata.total_groups * metadata.mean_puzzle_examples / global_batch_size)


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
                 process_count: int = 1, max_examples: int | None = None, seed: int = 0):
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


def train_rows_per_second(dataset: Dataset, global_batch_size: int, process_count: int = 1,
                          steps: int = 200, runs: int = 1) -> float:
    """Rows per second that host 0 of ``process_count`` gets from TrainBatches: the median of
    ``runs`` timings of ``steps`` consecutive batches each, after one untimed batch."""
    batches = TrainBatches(dataset, global_batch_size, seed=0, process_index=0,
                           process_count=process_count)
    batches.batch(0)
    rows = global_batch_size // process_count
    rates, step = [], 1
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps):
            batches.batch(step)
            step += 1
        rates.append(steps * rows / (time.perf_counter() - start))
    return statistics.median(rates)


class PrefetchedBatches:
    """The global batch of each training step, read and uploaded to the devices on a background
    thread while the step before it runs (as torch_xla's MpDeviceLoader does), so the loop only
    waits for data when reading is slower than a step. Batches depend only on the step, so
    prefetching changes no result."""

    def __init__(self, load, first_step: int, last_step: int):
        self.load, self.last_step = load, last_step
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trm-batches")
        self.pending = {first_step: self.thread.submit(load, first_step)} if first_step <= last_step else {}

    def get(self, step: int) -> dict:
        future = self.pending.pop(step, None) or self.thread.submit(self.load, step)
        batch = future.result()  # raises here if reading or uploading failed
        if step < self.last_step:
            self.pending[step + 1] = self.thread.submit(self.load, step + 1)
        return batch

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)
