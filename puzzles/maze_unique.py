"""EqR's Maze-Unique dataset, generated locally in our dataset format:

    build_maze_unique(out, MazeUniqueOptions(...))

Each example is a maze on the grid_size x grid_size board: walls "#", open cells " ", a start "S"
and a goal "G" whose shortest path has a length drawn from a distribution (EqR's recipe: uniform
on 100..140); the label marks the cells strictly between them on that path "o". Tokens are
build_maze's (MAZE_CHARSET "# SGo" -> 1..5, 0 pad; vocab 6, seq grid_size²), one group of one
example per maze, puzzle identifier 0.

Perfect mazes (maze_mode "perfect", the recipe's) are carved by a randomised depth-first search on
the cells at odd coordinates (an even grid_size leaves its last row and column wall): a tree, so the
shortest path is the only path. "random" mazes are open cells with probability 1 - wall_prob;
require_unique then keeps a start and goal only if their shortest path is the only shortest one.
Start: a random open cell; goal: a random cell at exactly the drawn distance; up to
max_grid_attempts mazes of max_start_attempts starts each. dedupe: no input twice across train
and test (a duplicate draws a new length, at most max_length_resamples times per example).

Faithfulness: this is github.com/locuslab/EqR's dataset/build_maze_unique_dataset.py (commit
4d45856) rewritten. With the same options and seed it makes the same draws from one
np.random.default_rng(seed) in the same order (train, then test), so its inputs, labels and index
arrays equal EqR's example for example; tests/test_maze_unique.py runs EqR's file (vendored in
tests/reference/eqr/dataset/) beside it. The differences: dataset.json has `total_puzzles` (our
data.py requires it) where EqR writes `total_samples` (the same number), and options EqR would run
with and then fail on or silently clamp (a length no maze of the grid can have, min_path_length 0)
are refused before any maze is made, naming the flag to change.

Imports numpy, the standard library, data.py and puzzles/builders.py (never torch).
"""
from __future__ import annotations

import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data import DatasetError, SplitAccumulator, write_identifiers
from puzzles.builders import MAZE_CHARSET

MAZE_MODES = ("perfect", "random")
LENGTH_DISTRIBUTIONS = ("uniform", "normal", "fixed", "list")
# The order in which a cell's neighbours are listed. The carving draws among the unvisited ones in
# this order and the breadth-first search queues them in it, so it is part of the recipe: EqR's.
STEPS = ((1, 0), (-1, 0), (0, 1), (0, -1))
WALL, OPEN, START, GOAL, PATH = (MAZE_CHARSET.index(c) + 1 for c in "# SGo")  # build_maze's tokens
PROGRESS_SECONDS = 5.0  # a progress line at most this often


@dataclass(frozen=True)
class MazeUniqueOptions:
    """EqR's options (its DataProcessConfig, less output_dir), with its published recipe's values
    as defaults: `python build_data.py build-maze-unique --out DIR` builds the dataset EqR's
    README builds (and the eqr-maze preset trains on)."""

    grid_size: int = 30
    train_samples: int = 1000
    test_samples: int = 1000
    maze_mode: str = "perfect"
    """"perfect" (randomised depth-first search) or "random" (independent walls)."""
    wall_prob: float = 0.37
    """A cell's chance of being wall in a random maze."""
    dedupe: bool = True
    length_distribution: str = "uniform"
    """The shortest path's length: uniform on min..max; normal(length_mean, length_std) rounded
    and clipped to min..max; fixed at length_value; list: one of length_values (weights
    length_weights, default equal)."""
    min_path_length: int = 100
    max_path_length: int = 140
    length_mean: float = 120.0
    length_std: float = 30.0
    length_value: int = 120
    length_values: tuple[int, ...] | None = None
    length_weights: tuple[float, ...] | None = None
    strict_length: bool = True
    """Stop with an error when no maze has a drawn length (else draw another length)."""
    require_unique: bool = True
    """Random mazes: keep only start/goal pairs with one shortest path (perfect mazes have one)."""
    max_length_resamples: int = 50
    max_grid_attempts: int = 200
    max_start_attempts: int = 200
    seed: int = 42


def maze_side(options: MazeUniqueOptions) -> int:
    """Side of the square the maze occupies: a perfect maze needs an odd side (cells at odd
    coordinates, walls around them), so an even grid keeps its last row and column wall."""
    size = options.grid_size
    return size if options.maze_mode == "random" or size % 2 else size - 1


def longest_possible_path(options: MazeUniqueOptions) -> int:
    """No shortest path is longer than the open cells of the grid's mazes minus one: all cells in
    a random maze; in a perfect one c² cells and the c² - 1 passages between them (c = cells per
    side). A perfect maze reaches it only if its tree is a single corridor, which randomised
    depth-first search rarely carves: long lengths are possible but rare."""
    if options.maze_mode == "random":
        return options.grid_size ** 2 - 1
    cells = (maze_side(options) - 1) // 2
    return max(2 * cells * cells - 2, 0)


def _length_support(options: MazeUniqueOptions) -> tuple[list[str], int, int]:
    """(the flags that set the drawn lengths, least, greatest)."""
    kind = options.length_distribution
    if kind == "fixed":
        return ["--length-value"], options.length_value, options.length_value
    if kind == "list":
        values = list(options.length_values or ())
        return ["--length-values"], min(values), max(values)
    return ["--min-path-length", "--max-path-length"], options.min_path_length, options.max_path_length


def check_options(options: MazeUniqueOptions) -> None:
    """DatasetError naming the flag and its fix for options that cannot build a dataset (or that
    EqR's builder would silently change)."""
    size = options.grid_size
    if options.maze_mode not in MAZE_MODES:
        raise DatasetError(f"--maze-mode {options.maze_mode!r}: use one of {', '.join(MAZE_MODES)}.")
    if options.length_distribution not in LENGTH_DISTRIBUTIONS:
        raise DatasetError(f"--length-distribution {options.length_distribution!r}: use one of "
                           f"{', '.join(LENGTH_DISTRIBUTIONS)}.")
    least_size = 5 if options.maze_mode == "perfect" else 2
    if size < least_size:
        raise DatasetError(f"--grid-size {size}: a {options.maze_mode} maze needs a grid of at least "
                           f"{least_size}x{least_size} (a perfect maze's cells sit at odd coordinates "
                           "inside a wall border: 5x5 holds 2x2 cells).")
    for flag, value in (("--train-samples", options.train_samples), ("--test-samples", options.test_samples)):
        if value < 1:
            raise DatasetError(f"{flag} {value}: each split needs at least 1 maze.")
    for flag, value in (("--max-length-resamples", options.max_length_resamples),
                        ("--max-grid-attempts", options.max_grid_attempts),
                        ("--max-start-attempts", options.max_start_attempts)):
        if value < 1:
            raise DatasetError(f"{flag} {value}: needs at least 1 (EqR's recipe: 50, 200, 200).")
    if not 0 <= options.wall_prob < 1:
        raise DatasetError(f"--wall-prob {options.wall_prob}: a probability in [0, 1) (EqR's default 0.37).")
    kind = options.length_distribution
    if kind in ("uniform", "normal") and options.min_path_length > options.max_path_length:
        raise DatasetError(f"--min-path-length {options.min_path_length} is above --max-path-length "
                           f"{options.max_path_length}; swap them.")
    if kind == "normal" and not options.length_std > 0:
        raise DatasetError(f"--length-std {options.length_std}: the normal distribution needs a "
                           "positive standard deviation.")
    if kind == "list":
        values, weights = options.length_values, options.length_weights
        if not values:
            raise DatasetError("--length-distribution list needs --length-values (e.g. --length-values 100 120 140).")
        if weights is not None:
            if len(weights) != len(values):
                raise DatasetError(f"--length-weights has {len(weights)} values for {len(values)} "
                                   "--length-values; give one weight per length.")
            if min(weights) < 0 or not sum(weights) > 0:
                raise DatasetError(f"--length-weights {list(weights)}: non-negative, with a positive sum.")
    flags, least, greatest = _length_support(options)
    if least < 1:
        raise DatasetError(f"{flags[0]} {least}: a shortest path from S to G has length at least 1 "
                           "(S and G are different cells).")
    longest = longest_possible_path(options)
    if greatest > longest:
        where = (f"a perfect maze on the {size}x{size} grid has {longest + 1} open cells"
                 if options.maze_mode == "perfect" else f"the {size}x{size} grid has {size * size} cells")
        raise DatasetError(f"{flags[-1]} {greatest} is impossible: {where}, so no shortest path is "
                           f"longer than {longest}. Draw shorter paths or use a larger --grid-size "
                           "(EqR's recipe: --min-path-length 100 --max-path-length 140 on 30x30).")


# --------------------------------------------------------------------------------------------
# One maze: carve, search, encode
# --------------------------------------------------------------------------------------------

def carve_perfect_maze(side: int, rng: np.random.Generator) -> np.ndarray:
    """A side x side open mask (side odd) of a perfect maze: randomised depth-first search over
    the cells at odd coordinates from a random cell, stepping to a random unvisited neighbour
    (listed in STEPS order) and opening the wall between, backing up when there is none."""
    cells = (side - 1) // 2
    is_open = np.zeros((side, side), dtype=bool)
    visited = [[False] * cells for _ in range(cells)]
    first = (int(rng.integers(cells)), int(rng.integers(cells)))
    trail = [first]
    visited[first[0]][first[1]] = True
    is_open[2 * first[0] + 1, 2 * first[1] + 1] = True
    while trail:
        row, col = trail[-1]
        fresh = [(row + dr, col + dc) for dr, dc in STEPS
                 if 0 <= row + dr < cells and 0 <= col + dc < cells and not visited[row + dr][col + dc]]
        if not fresh:
            trail.pop()
            continue
        next_row, next_col = fresh[int(rng.integers(len(fresh)))]
        visited[next_row][next_col] = True
        is_open[row + next_row + 1, col + next_col + 1] = True  # the wall between the two cells
        is_open[2 * next_row + 1, 2 * next_col + 1] = True
        trail.append((next_row, next_col))
    return is_open


def breadth_first(is_open: np.ndarray, start: int) -> tuple[list[int], list[int], list[int]]:
    """(distance from `start` of every cell, flat row-major indices, -1 where unreachable; each
    reached cell's predecessor on the first shortest path found, neighbours queued in STEPS order;
    the reached cells in the order they were reached)."""
    side = is_open.shape[0]
    open_cells = is_open.ravel().tolist()
    distance = [-1] * (side * side)
    before = [-1] * (side * side)
    distance[start] = 0
    queue, order = deque([start]), []
    while queue:
        cell = queue.popleft()
        order.append(cell)
        row, col = divmod(cell, side)
        for dr, dc in STEPS:
            r, c = row + dr, col + dc
            if 0 <= r < side and 0 <= c < side:
                near = r * side + c
                if open_cells[near] and distance[near] < 0:
                    distance[near] = distance[cell] + 1
                    before[near] = cell
                    queue.append(near)
    return distance, before, order


def shortest_path_is_unique(is_open: np.ndarray, distance: list[int], order: list[int], goal: int) -> bool:
    """Whether exactly one shortest path leads from the search's start to `goal`: shortest paths
    into each cell counted (up to 2) in the order the search reached them."""
    side = is_open.shape[0]
    paths = [0] * (side * side)
    paths[order[0]] = 1
    for cell in order[1:]:
        row, col = divmod(cell, side)
        count = 0
        for dr, dc in STEPS:
            r, c = row + dr, col + dc
            if 0 <= r < side and 0 <= c < side and distance[r * side + c] == distance[cell] - 1:
                count += paths[r * side + c]
        paths[cell] = min(count, 2)
        if cell == goal:
            break
    return paths[goal] == 1


def draw_length(rng: np.random.Generator, options: MazeUniqueOptions) -> int:
    """One shortest-path length from the options' distribution (check_options has run)."""
    kind = options.length_distribution
    if kind == "uniform":
        return int(rng.integers(options.min_path_length, options.max_path_length + 1))
    if kind == "normal":
        drawn = int(round(rng.normal(options.length_mean, options.length_std)))
        return min(options.max_path_length, max(options.min_path_length, drawn))
    if kind == "fixed":
        return options.length_value
    values = [int(v) for v in options.length_values]
    probabilities = None
    if options.length_weights is not None:
        weights = np.array(options.length_weights, dtype=np.float64)
        probabilities = weights / float(weights.sum())
    return int(rng.choice(values, p=probabilities))


def find_maze(rng: np.random.Generator, options: MazeUniqueOptions,
              length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(input, label) tokens [grid_size²] of a maze whose start and goal are `length` apart, or
    None when max_grid_attempts mazes of max_start_attempts random starts each had none."""
    size, side = options.grid_size, maze_side(options)
    for _ in range(options.max_grid_attempts):
        if options.maze_mode == "perfect":
            is_open = np.zeros((size, size), dtype=bool)
            is_open[:side, :side] = carve_perfect_maze(side, rng)
        else:
            is_open = rng.random((size, size)) >= options.wall_prob
        open_cells = np.flatnonzero(is_open)
        if len(open_cells) < max(length + 1, 2):
            continue
        for _ in range(options.max_start_attempts):
            start = int(open_cells[rng.integers(len(open_cells))])
            distance, before, order = breadth_first(is_open, start)
            goals = np.flatnonzero(np.array(distance) == length)
            if len(goals) == 0:
                continue
            goal = int(goals[rng.integers(len(goals))])
            if options.require_unique and options.maze_mode != "perfect" \
                    and not shortest_path_is_unique(is_open, distance, order, goal):
                continue
            inputs = np.where(is_open.ravel(), OPEN, WALL).astype(np.uint8)
            inputs[start], inputs[goal] = START, GOAL
            labels = inputs.copy()
            cell = before[goal]
            while cell != start:
                labels[cell] = PATH
                cell = before[cell]
            return inputs, labels
    return None


# --------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------

def _build_split(accumulator: SplitAccumulator, split: str, count: int, options: MazeUniqueOptions,
                 rng: np.random.Generator, seen: set | None) -> list[int]:
    """Add `count` mazes to the split, one group each; returns their path lengths."""
    lengths: list[int] = []
    began = last_report = time.monotonic()
    for example in range(count):
        for _ in range(options.max_length_resamples):
            length = draw_length(rng, options)
            maze = find_maze(rng, options, length)
            if maze is None:
                if options.strict_length:
                    raise DatasetError(
                        f"No {options.grid_size}x{options.grid_size} {options.maze_mode} maze with a shortest "
                        f"path of length {length} ({split} maze {example + 1}): {options.max_grid_attempts} "
                        f"mazes x {options.max_start_attempts} random starts tried. Draw shorter paths "
                        f"({_length_support(options)[0][-1]}; long paths are rare, the longest possible is "
                        f"{longest_possible_path(options)}), raise --max-grid-attempts/--max-start-attempts, "
                        "or pass --no-strict-length to draw another length instead.")
                continue
            inputs, labels = maze
            if seen is not None:
                if inputs.tobytes() in seen:
                    continue
                seen.add(inputs.tobytes())
            accumulator.add_group(inputs[None], labels[None], [1], [0])
            lengths.append(length)
            break
        else:
            raise DatasetError(
                f"{options.max_length_resamples} lengths drawn in a row for {split} maze {example + 1} gave "
                + ("duplicates of earlier mazes or " if seen is not None else "")
                + "no maze: the options admit too few distinct mazes. Widen the length range, use a larger "
                "--grid-size, ask for fewer --train-samples/--test-samples, or raise --max-length-resamples.")
        if time.monotonic() - last_report >= PROGRESS_SECONDS:
            last_report = time.monotonic()
            print(f"maze-unique: {split} {example + 1}/{count} mazes ({last_report - began:.0f} s)", flush=True)
    print(f"maze-unique: {split} {count} mazes in {time.monotonic() - began:.1f} s, shortest paths "
          f"{min(lengths)}..{max(lengths)} (mean {np.mean(lengths):.2f})", flush=True)
    return lengths


def build_maze_unique(out: str, options: MazeUniqueOptions | None = None) -> None:
    """Write EqR's Maze-Unique (see the module's docstring; default options: EqR's recipe) to the
    dataset root `out`: train/ and test/ splits (one maze per group) and identifiers.json
    (["<blank>"])."""
    options = options or MazeUniqueOptions()
    check_options(options)
    rng = np.random.default_rng(options.seed)
    seen = set() if options.dedupe else None
    with tempfile.TemporaryDirectory() as workdir:
        for split, count in (("train", options.train_samples), ("test", options.test_samples)):
            accumulator = SplitAccumulator(options.grid_size ** 2, workdir, split)
            _build_split(accumulator, split, count, options, rng, seen)
            accumulator.write(out, split, vocab_size=PATH + 1, num_puzzle_identifiers=1)
    write_identifiers(out, ["<blank>"])


def options_from(values: dict) -> MazeUniqueOptions:
    """MazeUniqueOptions from a mapping of its field names (e.g. argparse's), unknown keys ignored,
    lists made tuples."""
    names = MazeUniqueOptions.__dataclass_fields__
    chosen = {k: (tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else v)
              for k, v in values.items() if k in names and v is not None}
    return MazeUniqueOptions(**chosen)
