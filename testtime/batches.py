"""The evaluation batches of test-time scaling: K rows per puzzle, any K. Each host's rows of a
batch (host_rows = global_batch_size / hosts) hold host_rows // K puzzles, each K times in a row,
then padding rows (labels all ignored) up to host_rows: every batch has the global batch's shape,
so one program serves them all, whether or not K divides the batch (testtime/noisy_trajectories.py's layout).
"""
from __future__ import annotations

import numpy as np

from data import IGNORE_LABEL_ID, EvalBatches


def host_puzzles(global_batch_size: int, k: int, process_count: int) -> int:
    """Puzzles per host per batch at K trajectories: (global_batch_size / hosts) // K, at least 1."""
    rows = global_batch_size // process_count
    if k > 1 and rows < k:  # (K=1 is the batch itself, whatever its size says)
        raise ValueError(f"eval.trajectories K={k} exceeds the {rows} rows each of the {process_count} host(s) "
                         f"holds of a batch of {global_batch_size}: lower K or raise --optim.global-batch-size "
                         f"to at least {k * process_count}")
    return rows // k


def batch_puzzles(global_batch_size: int, k: int, process_count: int) -> int:
    """Puzzles of one global evaluation batch at K trajectories, as eval_batches lays them out: the
    batch itself at K=1, else every host's host_puzzles (ValueError for a K above a host's rows)."""
    return global_batch_size if k == 1 else host_puzzles(global_batch_size, k, process_count) * process_count


class TrajectoryBatches:
    """EvalBatches of host_puzzles(...) * hosts puzzles per batch, each host's puzzles' rows
    repeated K times and padded to its share of the global batch."""

    def __init__(self, puzzles: EvalBatches, k: int, host_rows: int):
        self.puzzles, self.k, self.host_rows = puzzles, k, host_rows
        metadata = puzzles.dataset.metadata
        self.pad_values = {"inputs": metadata.pad_id, "labels": IGNORE_LABEL_ID,
                           "puzzle_identifiers": metadata.blank_identifier_id}

    @property
    def num_examples(self) -> int:
        return self.puzzles.num_examples

    @property
    def dataset(self):
        return self.puzzles.dataset

    def __len__(self) -> int:
        return len(self.puzzles)

    def valid(self, index: int) -> np.ndarray:
        rows = np.repeat(self.puzzles.valid(index), self.k)
        return np.concatenate([rows, np.zeros(self.host_rows - len(rows), bool)])

    def batch(self, index: int) -> dict:
        out = {}
        for name, rows in self.puzzles.batch(index).items():
            rows = np.repeat(rows, self.k, axis=0)
            pad = np.full((self.host_rows - len(rows),) + rows.shape[1:], self.pad_values[name], rows.dtype)
            out[name] = np.concatenate([rows, pad])
        return out


def eval_batches(test_set, global_batch_size: int, k: int, process_index: int = 0, process_count: int = 1,
                 max_examples: int | None = None, seed: int = 0):
    """The evaluation batches at K trajectories (EvalBatches itself at K=1)."""
    if k == 1:
        return EvalBatches(test_set, global_batch_size, process_index, process_count, max_examples, seed)
    puzzles = EvalBatches(test_set, batch_puzzles(global_batch_size, k, process_count),
                          process_index=process_index, process_count=process_count,
                          max_examples=max_examples, seed=seed)
    return TrajectoryBatches(puzzles, k, global_batch_size // process_count)
