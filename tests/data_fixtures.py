"""Small data for the tests of data.py, build_data.py and puzzles/arc.py: synthetic datasets, tiny builder sources."""
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


def _maze_30x30(rng):
    """(question, answer) of one 30x30 maze: a random spanning tree carved on the odd cells
    (so the path from S to G is unique), plus a few knocked-out walls (loops, as in Maze-Hard);
    the answer marks a shortest S-G path with 'o'."""
    side, cells = 30, 14  # cells at odd coordinates 1..27; row and column 29 stay wall
    grid = np.full((side, side), "#")
    seen = np.zeros((cells, cells), bool)
    stack = [(int(rng.integers(cells)), int(rng.integers(cells)))]
    seen[stack[0]] = True
    grid[2 * stack[0][0] + 1, 2 * stack[0][1] + 1] = " "
    while stack:
        r, c = stack[-1]
        options = [(r + dr, c + dc) for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0))
                   if 0 <= r + dr < cells and 0 <= c + dc < cells and not seen[r + dr, c + dc]]
        if not options:
            stack.pop()
            continue
        nr, nc = options[int(rng.integers(len(options)))]
        seen[nr, nc] = True
        grid[r + nr + 1, c + nc + 1] = grid[2 * nr + 1, 2 * nc + 1] = " "
        stack.append((nr, nc))
    for _ in range(10):
        r, c = int(rng.integers(1, side - 2)), int(rng.integers(1, side - 2))
        if (r + c) % 2:  # a wall between two cells
            grid[r, c] = " "
    open_cells = np.argwhere(grid == " ")
    start, goal = (tuple(open_cells[i]) for i in rng.choice(len(open_cells), 2, replace=False))
    previous = {start: None}
    queue = [start]
    for cell in queue:  # breadth-first search
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            step = (cell[0] + dr, cell[1] + dc)
            if grid[step] == " " and step not in previous:
                previous[step] = cell
                queue.append(step)
    question = grid.copy()
    question[start], question[goal] = "S", "G"
    answer = question.copy()
    cell = previous[goal]
    while cell != start:
        answer[cell] = "o"
        cell = previous[cell]
    return "".join(question.ravel()), "".join(answer.ravel())


def maze_30x30_csv(path, count, seed):
    """A Maze-Hard-like CSV of ``count`` 30x30 mazes (seq_len 900, as the maze preset needs)."""
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "question", "answer", "rating"])
        for i in range(count):
            writer.writerow(["test", *_maze_30x30(rng), i])
    return path


# Rules of hand-made ARC tasks, each mapping an input grid to its output.
ARC_RULES = {
    "flip": np.fliplr,
    "transpose": lambda g: g.T,
    "recolour": lambda g: np.where(g == 1, 2, np.where(g == 2, 1, g)),
    "upscale": lambda g: np.kron(g, np.ones((2, 2), g.dtype)),
    "border": lambda g: np.pad(g, 1, constant_values=5),
}


def arc_rule_files(directory, seed, training=("flip", "recolour", "upscale"), evaluation=("transpose", "border")):
    """Kaggle-layout ARC files with one task per rule (3 train pairs and 1 test pair of random
    grids of 2..8 cells a side; training tasks include their test output, evaluation tasks have
    it in their solutions file). Returns the --input-prefix of build_data.py build-arc."""
    rng = np.random.default_rng(seed)
    prefix = os.path.join(directory, "arc")

    def pair():
        grid = rng.integers(0, 4, size=tuple(rng.integers(2, 9, size=2)))
        return {"input": grid.tolist(), "output": ARC_RULES[rule](grid).tolist()}

    for subset, rules in (("training", training), ("evaluation", evaluation)):
        challenges, solutions = {}, {}
        for rule in rules:
            name = f"{subset}_{rule}"
            tests = [pair()]
            challenges[name] = {"train": [pair() for _ in range(3)], "test": [{"input": t["input"]} for t in tests]}
            solutions[name] = [t["output"] for t in tests]
        for kind, content in (("challenges", challenges), ("solutions", solutions)):
            with open(f"{prefix}_{subset}_{kind}.json", "w") as f:
                json.dump(content, f)
    return prefix
