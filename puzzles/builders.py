"""The Sudoku, Maze and demo datasets' builders, in the reference's format, and the puzzles'
text: the builders' CSV strings encoded to tokens and back (train.py predict reads new puzzles
written that way). ARC's builder is build_arc.py; the command line over all of them is
build_data.py.
"""
from __future__ import annotations

import csv
import itertools
import math
import os
import tempfile
from collections.abc import Sequence

import numpy as np

from data import DatasetError, SplitAccumulator, write_identifiers
from puzzles.arc import dihedral_transform
from rundir.storage import access_errors, filesystem

# The public copies of the sources (the sapientinc datasets on Hugging Face).
_HF = "https://huggingface.co/datasets/sapientinc"
SUDOKU_CSV_URL = _HF + "/sudoku-extreme/resolve/main/{split}.csv"
MAZE_CSV_URL = _HF + "/maze-30x30-hard-1k/resolve/main/{split}.csv"
MAZE_CHARSET = "# SGo"  # wall, open, start, goal, path -> tokens 1..5 (0 is pad)


def read_puzzle_csv(url: str, min_difficulty: int | None = None) -> tuple[list, list]:
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


def _subsample(rng: np.random.Generator, items: list, size: int | None) -> list:
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


def maze_tokens(maze: str) -> np.ndarray:
    """Tokens of a maze string of the characters MAZE_CHARSET (wall, open, start, goal, path
    -> 1..5), as the Maze builder encodes them; other characters give 0 (pad)."""
    char_to_token = np.zeros(256, np.uint8)
    char_to_token[[ord(c) for c in MAZE_CHARSET]] = np.arange(1, len(MAZE_CHARSET) + 1)
    return char_to_token[np.frombuffer(maze.encode("latin-1", "replace"), np.uint8)]


def encode_puzzles(strings: Sequence[str], seq_len: int, vocab_size: int,
                   where: str = "--puzzle") -> tuple[str, np.ndarray]:
    """("sudoku" or "maze", tokens [len(strings), seq_len]) of new puzzles written as the
    builders read them from their CSV (a Sudoku: n*n digits, '.' or '0' blank; a maze: its
    cells in the characters of MAZE_CHARSET), encoded as build_sudoku / build_demo and
    build_maze encode them, for a model of ``seq_len`` and ``vocab_size``. DatasetError naming
    ``where`` when a string is neither or does not fit the model."""
    if not strings:
        raise DatasetError(f"{where}: no puzzles given.")
    side = math.isqrt(seq_len)
    kinds = set()
    for number, text in enumerate(strings, start=1):
        kind = ("sudoku" if set(text) <= set("0123456789.") else
                "maze" if set(text) <= set(MAZE_CHARSET) else None)
        which = f"{where} puzzle {number} ({text[:40]!r}{'...' if len(text) > 40 else ''})"
        if kind is None:
            raise DatasetError(f"{which} is neither a Sudoku (digits, '.' or '0' for blanks) nor a "
                               f"maze (the characters {MAZE_CHARSET!r}).")
        if len(text) != seq_len:
            raise DatasetError(f"{which} has {len(text)} cells but the model reads {seq_len} "
                               f"({side}x{side} grids).")
        kinds.add(kind)
    if len(kinds) > 1:
        raise DatasetError(f"{where}: mixes Sudokus and mazes; one model reads one kind.")
    kind = kinds.pop()
    if kind == "maze":
        if vocab_size != len(MAZE_CHARSET) + 1:
            raise DatasetError(f"{where}: a maze needs a Maze model (vocab_size "
                               f"{len(MAZE_CHARSET) + 1}), this one has vocab_size {vocab_size}.")
        return kind, np.stack([maze_tokens(text) for text in strings])
    digits = _digit_grids(list(strings), where, seq_len)
    if side * side != seq_len or vocab_size != side + 2:
        raise DatasetError(f"{where}: a {side}x{side} Sudoku needs a Sudoku model of vocab_size "
                           f"{side + 2} and seq_len {side * side}; this one has vocab_size "
                           f"{vocab_size} and seq_len {seq_len}.")
    if digits.max() > side:
        raise DatasetError(f"{where}: a {side}x{side} Sudoku has digits 1..{side} only.")
    return kind, digits + 1


def puzzle_string(kind: str, tokens: np.ndarray) -> str:
    """The inverse of encode_puzzles for one sequence, in the builders' CSV format (a Sudoku's
    blanks, or any token that is no digit, as '.'; a maze's pad as '?')."""
    tokens = np.asarray(tokens).reshape(-1)
    if kind == "maze":
        return "".join(MAZE_CHARSET[t - 1] if 1 <= t <= len(MAZE_CHARSET) else "?" for t in tokens)
    side = math.isqrt(len(tokens))
    return "".join(str(t - 1) if 2 <= t <= side + 1 else "." for t in tokens)


def puzzle_grid(text: str) -> str:
    """A puzzle string as a square grid, one row per line (Sudoku cells space-separated)."""
    side = math.isqrt(len(text))
    sep = "" if set(text) <= set(MAZE_CHARSET + "?") else " "
    return "\n".join(sep.join(text[r * side:(r + 1) * side]) for r in range(side))


def build_sudoku(out: str, train_csv: str = SUDOKU_CSV_URL.format(split="train"),
                 test_csv: str = SUDOKU_CSV_URL.format(split="test"),
                 subsample_size: int | None = None, min_difficulty: int | None = None,
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
            accumulator = SplitAccumulator(81, workdir, split)
            for puzzle, solution in zip(puzzles, solutions):
                inputs, labels = puzzle[None], solution[None]
                if augmentations:
                    more_inputs, more_labels = shuffle_sudoku(puzzle, solution, rng, augmentations)
                    inputs = np.concatenate([inputs, more_inputs])
                    labels = np.concatenate([labels, more_labels])
                accumulator.add_group(inputs + 1, labels + 1, [1] * len(inputs), [0] * len(inputs))
            accumulator.write(out, split, vocab_size=11, num_puzzle_identifiers=1)
    write_identifiers(out, ["<blank>"])


def build_maze(out: str, train_csv: str = MAZE_CSV_URL.format(split="train"),
               test_csv: str = MAZE_CSV_URL.format(split="test"),
               subsample_size: int | None = None, min_difficulty: int | None = None,
               aug: bool = False, seed: int = 0) -> None:
    """Maze-Hard in the reference format: characters "# SGo" -> tokens 1..5, vocab 6,
    seq = grid cells. With ``aug`` each train maze is a group of its 8 dihedral variants."""
    rng = np.random.default_rng(seed)
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
            accumulator = SplitAccumulator(seq_len, workdir, split)
            for question, answer in pairs:
                if len(question) != seq_len or set(question + answer) - set(MAZE_CHARSET):
                    raise DatasetError(f"{csv_url}: every maze must be a {side}x{side} grid of "
                                       f"the characters {MAZE_CHARSET!r}.")
                grids = [maze_tokens(s).reshape(side, side) for s in (question, answer)]
                transforms = range(8) if (aug and split == "train") else range(1)
                inputs = np.stack([dihedral_transform(grids[0], t).ravel() for t in transforms])
                labels = np.stack([dihedral_transform(grids[1], t).ravel() for t in transforms])
                accumulator.add_group(inputs, labels, [1] * len(inputs), [0] * len(inputs))
            accumulator.write(out, split, vocab_size=len(MAZE_CHARSET) + 1,
                              num_puzzle_identifiers=1)
    write_identifiers(out, ["<blank>"])


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
        train = SplitAccumulator(16, workdir, "train")
        for _ in range(train_puzzles):
            puzzle, solution = random_puzzle()
            inputs, labels = puzzle[None], solution[None]
            if num_aug:
                more_inputs, more_labels = shuffle_sudoku(puzzle, solution, rng, num_aug)
                inputs = np.concatenate([inputs, more_inputs])
                labels = np.concatenate([labels, more_labels])
            seen.update(row.tobytes() for row in inputs)
            train.add_group(inputs + 1, labels + 1, [1] * len(inputs), [0] * len(inputs))
        test = SplitAccumulator(16, workdir, "test")
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


def ensure_demo_data(data_path: str) -> None:
    """Build the demo dataset at `data_path` (a local path) unless it is there: `python train.py
    demo` works on a fresh checkout."""
    if not os.path.exists(data_path):
        print(f"building the demo dataset at {data_path}", flush=True)
        build_demo(data_path, seed=0)



