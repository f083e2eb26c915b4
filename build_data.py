"""Builders of TRM datasets in the reference format (Sudoku, Maze, ARC, the demo), and their command line.

Each builder writes a dataset root (a local path or any fsspec URL) that data.py reads:
    build_sudoku(out, train_csv, test_csv, subsample_size, min_difficulty, num_aug, seed)
    build_maze(out, train_csv, test_csv, subsample_size, min_difficulty, aug, seed)
    build_arc(out, input_prefix, subsets, test_sets, num_aug, seed=ARC_SEED)   (build_arc.py)
        writes, byte for byte, what the reference's dataset/build_arc_dataset.py writes from
        the same files and options (seed 42 by default)
    build_demo(out, ...)   4x4 Sudoku generated locally, small enough to train on a laptop CPU

Command line:
    python build_data.py build-sudoku | build-maze | build-arc | build-demo --out URL ...
    python build_data.py info URL      metadata, sizes and a sample
    python build_data.py bench URL     TrainBatches rows per second from the local cache

This module imports numpy, the standard library, storage.py, data.py, batches.py, arc.py and
build_arc.py (never torch):
training does not import it.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

from arc import dihedral_transform
from batches import train_rows_per_second
from build_arc import ARC_SEED, build_arc
from data import (
    ARRAY_NAMES,
    SPLITS,
    DatasetError,
    SplitAccumulator,
    npy_header,
    open_dataset,
    read_identifiers,
    read_metadata,
    write_identifiers,
)
from storage import StorageError, access_errors, filesystem, join_url

# --------------------------------------------------------------------------------------------
# Sudoku and Maze builders
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# info, bench and the command line
# --------------------------------------------------------------------------------------------

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
        metadata = read_metadata(url, split)
        print(f"\n[{split}] {json.dumps(metadata.to_dict())}")
        fs, split_path = filesystem(join_url(url, split))
        headers = {}
        for name in ARRAY_NAMES:
            path = join_url(split_path, f"{metadata.sets[0]}__{name}.npy")
            with access_errors(url, DatasetError):
                if not fs.exists(path):
                    print(f"  {name:20s} MISSING")
                    continue
                headers[name] = npy_header(fs, path)
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
          cache_dir: str | None = None) -> float:
    """Rows per second that one host gets from TrainBatches (after the dataset is cached)."""
    dataset = open_dataset(url, "train", cache_dir)
    rows_per_second = train_rows_per_second(dataset, global_batch_size, process_count, steps)
    print(f"{url}: {rows_per_second:,.0f} rows/s per host ({steps} steps, global batch "
          f"{global_batch_size}, {process_count} host(s), seq_len {dataset.metadata.seq_len})")
    return rows_per_second


def command_parser() -> argparse.ArgumentParser:
    """The command line of build_data.py: one subcommand per builder, info and bench."""
    parser = argparse.ArgumentParser(
        prog="build_data.py", description="Build, inspect and benchmark TRM puzzle datasets "
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
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = command_parser().parse_args(argv)
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
