"""Builders of TRM datasets in the reference format (Sudoku, Maze, ARC, the demo), and their command line.

Each builder writes a dataset root (a local path or any fsspec URL) that data.py reads:
    build_sudoku(out, train_csv, test_csv, subsample_size, min_difficulty, num_aug, seed)
    build_maze(out, train_csv, test_csv, subsample_size, min_difficulty, aug, seed)
    build_arc(out, input_prefix, subsets, test_sets, num_aug, seed=ARC_SEED)   (puzzles/build_arc.py)
        writes, byte for byte, what the reference's dataset/build_arc_dataset.py writes from
        the same files and options (seed 42 by default)
    build_maze_unique(out, MazeUniqueOptions(...))   (puzzles/maze_unique.py)
        EqR's Maze-Unique, generated locally (the eqr-maze preset's dataset; the defaults are
        EqR's recipe): with the same options the mazes equal EqR's builder's, example for example
    build_demo(out, ...)   4x4 Sudoku generated locally, small enough to train on a laptop CPU

Command line:
    python build_data.py build-sudoku | build-maze | build-maze-unique | build-arc | build-demo --out URL ...
    python build_data.py info URL      metadata, sizes and a sample
    python build_data.py bench URL     TrainBatches rows per second from the local cache

This module imports numpy, the standard library, rundir/storage.py, data.py, puzzles/builders.py,
puzzles/build_arc.py and puzzles/maze_unique.py (never torch):
training does not import it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

import numpy as np

from data import (
    ARRAY_NAMES,
    SPLITS,
    DatasetError,
    npy_header,
    open_dataset,
    read_identifiers,
    read_metadata,
    train_rows_per_second,
)
from puzzles.build_arc import ARC_SEED, build_arc
from puzzles.builders import MAZE_CSV_URL, SUDOKU_CSV_URL, build_demo, build_maze, build_sudoku
from puzzles.maze_unique import LENGTH_DISTRIBUTIONS, MAZE_MODES, MazeUniqueOptions, build_maze_unique, options_from
from rundir.storage import StorageError, access_errors, filesystem, join_url

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


def maze_unique_options(sub: argparse.ArgumentParser) -> None:
    """build-maze-unique's flags: EqR's option names, MazeUniqueOptions' defaults (EqR's recipe)."""
    recipe = MazeUniqueOptions()

    def flag(name, help_text, **kwargs):
        field = name[2:].replace("-", "_")
        default = getattr(recipe, field)
        if default is not None:
            help_text += f" (default {str(default).lower() if isinstance(default, bool) else default})"
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.setdefault("type", type(default) if default is not None else int)
        sub.add_argument(name, default=default, help=help_text, **kwargs)

    flag("--grid-size", "side of the square board")
    flag("--train-samples", "mazes in train")
    flag("--test-samples", "mazes in test")
    flag("--maze-mode", "perfect: randomised depth-first search (one path between any two cells); "
         "random: each cell wall with probability --wall-prob", choices=MAZE_MODES)
    flag("--wall-prob", "random mazes' wall probability")
    flag("--dedupe", "no maze twice across train and test")
    flag("--length-distribution", "the start-goal shortest path's length: uniform on --min..--max-path-length, "
         "normal (--length-mean, --length-std, clipped to min..max), fixed (--length-value), list "
         "(--length-values, --length-weights)", choices=LENGTH_DISTRIBUTIONS)
    flag("--min-path-length", "shortest path length, least")
    flag("--max-path-length", "shortest path length, greatest")
    flag("--length-mean", "normal distribution's mean")
    flag("--length-std", "normal distribution's standard deviation")
    flag("--length-value", "fixed length")
    flag("--length-values", "list: the lengths", nargs="+")
    flag("--length-weights", "list: their weights (default equal)", nargs="+", type=float)
    flag("--strict-length", "stop when no maze has a drawn length (else draw another)")
    flag("--require-unique", "random mazes: keep only start-goal pairs with a single shortest path "
         "(a perfect maze has one)")
    flag("--max-length-resamples", "lengths drawn per maze before giving up (after duplicates or failures)")
    flag("--max-grid-attempts", "mazes tried per drawn length")
    flag("--max-start-attempts", "random starts tried per maze")


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
    maze_unique_options(command(
        "build-maze-unique", "Build EqR's Maze-Unique (mazes generated locally, no download): the "
        "eqr-maze preset's dataset. The defaults are EqR's recipe (its README's command); with the "
        "same options and seed the mazes equal its dataset/build_maze_unique_dataset.py's.",
        seed=MazeUniqueOptions.seed))
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
        elif args.command == "build-maze-unique":
            build_maze_unique(args.out, options_from(vars(args)))
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
