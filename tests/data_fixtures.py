"""Small data for the tests of data.py, build_data.py and arc.py: synthetic datasets, tiny builder sources."""
import csv
import json
import os

import numpy as np

import data


def write_synthetic(url, num_groups=12, puzzles_per_group=3, sizes=(1, 4), seq_len=8,
                    vocab_size=10, seed=0, split_seq_len=None):
    """A dataset at ``url`` whose rows say who they are: inputs[:, 0:3] hold the example index
    (base 256) and every puzzle has its own identifier (1..puzzles). Puzzle sizes are drawn
    uniformly from sizes[0]..sizes[1]; about a fifth of the labels equal ignore_label_id 0."""
    rng = np.random.default_rng(seed)
    for split in data.SPLITS:
        length = (split_seq_len or {}).get(split, seq_len)
        num_puzzles = num_groups * puzzles_per_group
        puzzle_sizes = rng.integers(sizes[0], sizes[1] + 1, size=num_puzzles)
        num_examples = int(puzzle_sizes.sum())
        inputs = rng.integers(1, vocab_size, size=(num_examples, length)).astype(np.uint8)
        index = np.arange(num_examples)
        inputs[:, 0], inputs[:, 1], inputs[:, 2] = index % 256, index // 256 % 256, index // 65536
        labels = rng.integers(0, 5, size=(num_examples, length)).astype(np.uint8)
        metadata = data.Metadata(
            pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=256, seq_len=length,
            num_puzzle_identifiers=num_puzzles + 1, total_groups=num_groups,
            mean_puzzle_examples=num_examples / num_puzzles, total_puzzles=num_puzzles,
            sets=("all",))
        data.write_split(url, split, metadata, {
            "inputs": inputs, "labels": labels,
            "puzzle_identifiers": np.arange(1, num_puzzles + 1),
            "puzzle_indices": np.concatenate(([0], np.cumsum(puzzle_sizes))),
            "group_indices": np.arange(0, num_puzzles + 1, puzzles_per_group)})
    names = [f"puzzle {i}" for i in range(num_groups * puzzles_per_group)]
    data.write_identifiers(url, ["<blank>"] + names)


def example_index(inputs):
    """Inverse of the row labelling of write_synthetic."""
    return inputs[:, 0] + 256 * inputs[:, 1] + 65536 * inputs[:, 2]


def is_solved_sudoku(grid):
    """True if ``grid`` (flat n*n digits 1..n) is a solved Sudoku."""
    n = int(round(len(grid) ** 0.5))
    box = int(round(n ** 0.5))
    g = np.asarray(grid).reshape(n, n)
    boxes = g.reshape(box, box, box, box).transpose(0, 2, 1, 3).reshape(n, n)
    want = np.arange(1, n + 1)
    return all(np.array_equal(np.sort(lines, axis=1), np.tile(want, (n, 1)))
               for lines in (g, g.T, boxes))


def sudoku_csv(path, count, seed):
    """A Sudoku-Extreme-like CSV of ``count`` 9x9 puzzles with ratings 0..count-1."""
    rng = np.random.default_rng(seed)
    r, c = np.indices((9, 9))
    base = (r * 3 + r // 3 + c) % 9  # a valid solved grid, relabelled per puzzle below
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "question", "answer", "rating"])
        for i in range(count):
            solution = (rng.permutation(9) + 1)[base].ravel()
            puzzle = solution.copy()
            puzzle[rng.choice(81, size=45, replace=False)] = 0
            writer.writerow(["test", "".join(map(str, puzzle)).replace("0", "."),
                             "".join(map(str, solution)), i])
    return path


def maze_csv(path, count):
    """A Maze-Hard-like CSV of ``count`` 4x4 mazes."""
    question, answer = "S  ## # #  #  G ", "Soo## #o#oo#o oG"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "question", "answer", "rating"])
        for i in range(count):
            writer.writerow(["test", question, answer, i])
    return path


ARC_TRAINING = {
    "task_a": {"train": [{"input": [[1, 2], [3, 4]], "output": [[4, 3], [2, 1]]},
                         {"input": [[5, 0, 6]], "output": [[6, 0, 5]]}],
               "test": [{"input": [[7, 8]]}]},
    # Background only: every augmentation reproduces the task, so none may be kept.
    "task_blank": {"train": [{"input": [[0]], "output": [[0, 0], [0, 0]]}],
                   "test": [{"input": [[0, 0], [0, 0]]}]},
}
ARC_TRAINING_SOLUTIONS = {"task_a": [[[8, 7]]], "task_blank": [[[0]]]}
ARC_EVALUATION = {
    "task_e": {"train": [{"input": [[1, 1, 0], [2, 0, 0]], "output": [[2, 2]]}],
               "test": [{"input": [[3, 0], [0, 4], [5, 6]]}, {"input": [[9]]}]},
}
ARC_EVALUATION_SOLUTIONS = {"task_e": [[[3, 4, 5, 6]], [[9, 9]]]}


def arc_files(directory):
    """Kaggle-layout ARC files in ``directory``; returns the --input-prefix."""
    prefix = os.path.join(directory, "arc")
    for name, content in (("training_challenges", ARC_TRAINING),
                          ("training_solutions", ARC_TRAINING_SOLUTIONS),
                          ("evaluation_challenges", ARC_EVALUATION),
                          ("evaluation_solutions", ARC_EVALUATION_SOLUTIONS)):
        with open(f"{prefix}_{name}.json", "w") as f:
            json.dump(content, f)
    return prefix
