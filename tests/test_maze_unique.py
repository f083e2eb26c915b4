"""EqR's Maze-Unique (puzzles/maze_unique.py, `python build_data.py build-maze-unique`): maze for maze
what EqR's own builder writes (tests/reference/eqr/dataset/build_maze_unique_dataset.py, run beside
ours on small configs that reach each of its branches), the recipe's properties checked on the
mazes themselves, the command line's defaults = EqR's README command, and the errors."""
import dataclasses
import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest

import build_data
import data
from data import ARRAY_NAMES, SPLITS
from puzzles import maze_unique
from puzzles.maze_unique import MazeUniqueOptions, build_maze_unique
from tests.reference.loading import load_family

EQR_DATASET_DIR = Path(__file__).parent / "reference" / "eqr" / "dataset"
# EqR's README, "Build Maze-Unique" (its --output-dir left out): the dataset its eqr_maze_unique.yaml trains on.
EQR_README_FLAGS = ("--grid-size 30 --train-samples 1000 --test-samples 1000 --maze-mode perfect "
                    "--length-distribution uniform --min-path-length 100 --max-path-length 140 "
                    "--require-unique --dedupe").split()


def load_eqr_builder():
    """EqR's build_maze_unique_dataset.py, imported unchanged with its folder first on sys.path.
    `tqdm` (a progress bar: here one that does nothing) and `argdantic` (its command line: here a
    decorator that returns the function) are stand-ins; every sys.modules name touched is put back."""
    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            pass

    class ArgParser:
        def command(self, **kwargs):
            return lambda function: function

    return load_family(EQR_DATASET_DIR, "build_maze_unique_dataset",
                       stand_ins={"tqdm": {"tqdm": Bar}, "argdantic": {"ArgParser": ArgParser}},
                       packages=("common",))[0]


@pytest.fixture(scope="module")
def eqr_builder():
    return load_eqr_builder()


def build_both(eqr_builder, root: Path, name: str, **options):
    """(EqR's dataset root, ours) built with the same options: every option given to both (EqR's
    defaults are not its recipe, ours are)."""
    options = {**dataclasses.asdict(MazeUniqueOptions()), **options}
    eqr_out, our_out = root / f"{name}-eqr", root / f"{name}-ours"
    eqr_builder.preprocess_data(eqr_builder.DataProcessConfig(output_dir=str(eqr_out), **options))
    build_maze_unique(str(our_out), maze_unique.options_from(options))
    return eqr_out, our_out


def load_split(root: Path, split: str) -> tuple[dict, dict]:
    metadata = json.loads((root / split / "dataset.json").read_text())
    return metadata, {name: np.load(root / split / f"all__{name}.npy") for name in ARRAY_NAMES}


# Small configs that reach each branch of EqR's builder: perfect mazes on odd and even grids, random
# mazes with and without the unique-path check, every length distribution, duplicates skipped, and
# lengths with no maze drawn again (strict_length off). Each builds in well under a second.
CONFIGS = {
    "perfect-odd-uniform": dict(grid_size=15, train_samples=12, test_samples=12, maze_mode="perfect",
                                min_path_length=20, max_path_length=40, require_unique=True, dedupe=True),
    "perfect-even-normal": dict(grid_size=12, train_samples=10, test_samples=10, maze_mode="perfect",
                                length_distribution="normal", min_path_length=10, max_path_length=40,
                                length_mean=25.0, length_std=10.0, dedupe=True, seed=3),
    "perfect-tiny-list-dedupe": dict(grid_size=6, train_samples=6, test_samples=4, maze_mode="perfect",
                                     length_distribution="list", length_values=[2, 4, 6],
                                     length_weights=[1.0, 1.0, 2.0], dedupe=True, seed=1),
    "random-unique": dict(grid_size=8, train_samples=6, test_samples=6, maze_mode="random", wall_prob=0.3,
                          min_path_length=3, max_path_length=12, require_unique=True, dedupe=True, seed=5),
    "random-ties-fixed": dict(grid_size=8, train_samples=10, test_samples=10, maze_mode="random", wall_prob=0.15,
                              length_distribution="fixed", length_value=9, require_unique=False, seed=7),
    "random-not-strict": dict(grid_size=6, train_samples=8, test_samples=8, maze_mode="random", wall_prob=0.45,
                              min_path_length=1, max_path_length=20, strict_length=False, max_grid_attempts=2,
                              max_start_attempts=3, seed=11),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_mazes_are_eqrs_builders_example_for_example(name, eqr_builder, tmp_path):
    eqr_out, our_out = build_both(eqr_builder, tmp_path, name, **CONFIGS[name])
    for split in SPLITS:
        eqr_metadata, eqr_arrays = load_split(eqr_out, split)
        our_metadata, our_arrays = load_split(our_out, split)
        for array in ARRAY_NAMES:
            assert eqr_arrays[array].dtype == our_arrays[array].dtype, (split, array)
            np.testing.assert_array_equal(our_arrays[array], eqr_arrays[array], err_msg=f"{name} {split} {array}")
        # The one difference: EqR names the example count total_samples, data.py needs total_puzzles.
        eqr_metadata["total_puzzles"] = eqr_metadata.pop("total_samples")
        assert our_metadata == eqr_metadata
        data.open_dataset(str(our_out), split)  # our data.py reads it (and checks tokens against vocab_size)
    assert json.loads((our_out / "identifiers.json").read_text()) == ["<blank>"]
    assert (eqr_out / "identifiers.json").read_text() == (our_out / "identifiers.json").read_text()


def test_an_eqr_built_dataset_is_refused_with_the_fix_and_reads_after_it(eqr_builder, tmp_path):
    """EqR's own output (e.g. its published copy) lacks total_puzzles: the error says which field to
    add; with it added, data.py reads EqR's arrays, which are ours."""
    eqr_out, our_out = build_both(eqr_builder, tmp_path, "recipe", **CONFIGS["perfect-odd-uniform"])
    with pytest.raises(data.DatasetError, match=r'names its example count total_samples.*Add "total_puzzles"'):
        data.open_dataset(str(eqr_out), "train")
    for split in SPLITS:
        path = eqr_out / split / "dataset.json"
        metadata = json.loads(path.read_text())
        path.write_text(json.dumps({**metadata, "total_puzzles": metadata["total_samples"]}))
        theirs, ours = data.open_dataset(str(eqr_out), split), data.open_dataset(str(our_out), split)
        assert theirs.metadata == ours.metadata
        np.testing.assert_array_equal(theirs.inputs, ours.inputs)


def test_the_configs_reach_the_branches_they_are_for(eqr_builder, tmp_path):
    """The side-by-side configs do what their names say: the tiny one meets duplicates (without
    dedupe it keeps some), the unique one refuses start-goal pairs (without the check it keeps
    other mazes), the ties one has mazes whose shortest path is not the only one (so the label's
    path is the breadth-first search's choice), the not-strict one draws lengths no maze has (EqR's
    builder, strict, stops)."""
    tiny = dict(CONFIGS["perfect-tiny-list-dedupe"], dedupe=False)
    build_maze_unique(str(tmp_path / "tiny"), maze_unique.options_from(tiny))
    inputs = np.concatenate([load_split(tmp_path / "tiny", split)[1]["inputs"] for split in SPLITS])
    assert len({row.tobytes() for row in inputs}) < len(inputs)

    for name, unique in (("unique", True), ("any", False)):
        build_maze_unique(str(tmp_path / name),
                          maze_unique.options_from(dict(CONFIGS["random-unique"], require_unique=unique)))
    assert not np.array_equal(load_split(tmp_path / "unique", "train")[1]["inputs"],
                              load_split(tmp_path / "any", "train")[1]["inputs"])

    build_maze_unique(str(tmp_path / "ties"), maze_unique.options_from(CONFIGS["random-ties-fixed"]))
    inputs = load_split(tmp_path / "ties", "train")[1]["inputs"].reshape(-1, 8, 8)
    tied = 0
    for grid in inputs:
        start, goal = (int(np.flatnonzero(grid.ravel() == token)[0]) for token in (3, 4))
        distance, _, order = maze_unique.breadth_first(grid != 1, start)
        tied += not maze_unique.shortest_path_is_unique(grid != 1, distance, order, goal)
    assert tied > 0

    with pytest.raises(RuntimeError, match="Failed to generate a maze with shortest path length"):
        eqr_builder.preprocess_data(eqr_builder.DataProcessConfig(
            output_dir=str(tmp_path / "strict"), **dict(CONFIGS["random-not-strict"], strict_length=True)))


def test_perfect_mazes_have_the_recipes_properties(tmp_path):
    """On the mazes themselves: the open cells of a perfect maze are a tree (connected, one fewer
    passage than cells) inside the odd square (an even grid's last row and column are wall); one S,
    one G; the label is the input with exactly the cells strictly between them on the S-G path
    marked, a path of the drawn length (in min..max); no input twice across train and test."""
    options = dict(CONFIGS["perfect-odd-uniform"], grid_size=16, train_samples=8, test_samples=8)
    build_maze_unique(str(tmp_path), maze_unique.options_from(options))
    side, seen = 16, set()
    for split in SPLITS:
        _, arrays = load_split(tmp_path, split)
        for inputs, labels in zip(arrays["inputs"], arrays["labels"]):
            seen.add(inputs.tobytes())
            grid, label = inputs.reshape(side, side), labels.reshape(side, side)
            assert set(np.unique(grid)) == {1, 2, 3, 4} and (grid == 3).sum() == (grid == 4).sum() == 1
            assert (grid[-1] == 1).all() and (grid[:, -1] == 1).all() and (grid[0] == 1).all()
            is_open = grid != 1
            cells = {tuple(c) for c in np.argwhere(is_open)}
            passages = sum((r + 1, c) in cells for r, c in cells) + sum((r, c + 1) in cells for r, c in cells)
            assert passages == len(cells) - 1
            start = tuple(np.argwhere(grid == 3)[0])
            reached, queue = {start: 0}, deque([start])
            while queue:
                r, c = queue.popleft()
                for near in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                    if near in cells and near not in reached:
                        reached[near] = reached[(r, c)] + 1
                        queue.append(near)
            assert len(reached) == len(cells)  # connected: with the count above, a tree
            goal = tuple(np.argwhere(grid == 4)[0])
            length = reached[goal]
            assert options["min_path_length"] <= length <= options["max_path_length"]
            marked = label == 5
            assert (label[~marked] == grid[~marked]).all() and marked.sum() == length - 1
            # Each marked cell is one step further from S along the path: distances 1 .. length-1, once each.
            assert sorted(reached[tuple(c)] for c in np.argwhere(marked)) == list(range(1, length))
    assert len(seen) == 16


def test_the_default_command_is_eqrs_readme_command():
    parser = build_data.command_parser()
    readme = maze_unique.options_from(vars(parser.parse_args(["build-maze-unique", "--out", "x", *EQR_README_FLAGS])))
    bare = maze_unique.options_from(vars(parser.parse_args(["build-maze-unique", "--out", "x"])))
    assert readme == bare == MazeUniqueOptions()
    # Field by field against EqR's own config with the README's flags (its seed 42 is its default).
    eqr = load_eqr_builder()
    flags = dict(zip(EQR_README_FLAGS[:-2:2], EQR_README_FLAGS[1:-2:2]))
    eqr_config = eqr.DataProcessConfig(**{f[2:].replace("-", "_"): v for f, v in flags.items()},
                                       require_unique=True, dedupe=True)
    ours = MazeUniqueOptions()
    for name, value in eqr_config.model_dump().items():
        if name != "output_dir":
            assert getattr(ours, name) == (tuple(value) if isinstance(value, list) else value), name


def test_the_command_line_builds_what_the_function_builds(tmp_path, capsys, monkeypatch):
    small = ["--grid-size", "11", "--train-samples", "4", "--test-samples", "3", "--min-path-length", "10",
             "--max-path-length", "20", "--seed", "9"]
    monkeypatch.setattr(maze_unique, "PROGRESS_SECONDS", 0.0)  # a progress line after every maze
    build_data.main(["build-maze-unique", "--out", str(tmp_path / "cli"), *small])
    printed = capsys.readouterr().out
    assert "maze-unique: train 2/4 mazes (" in printed and "maze-unique: test 3/3 mazes (" in printed
    assert "maze-unique: train 4 mazes in" in printed and '"total_puzzles": 4' in printed
    build_maze_unique(str(tmp_path / "function"), MazeUniqueOptions(
        grid_size=11, train_samples=4, test_samples=3, min_path_length=10, max_path_length=20, seed=9))
    for split in SPLITS:
        assert load_split(tmp_path / "cli", split)[0]["total_puzzles"] == (4 if split == "train" else 3)
        for name, array in load_split(tmp_path / "cli", split)[1].items():
            np.testing.assert_array_equal(array, load_split(tmp_path / "function", split)[1][name])


@pytest.mark.parametrize("flags, message", [
    (["--max-path-length", "400"], "--max-path-length 400 is impossible: a perfect maze on the 30x30 grid has "
                                   "391 open cells, so no shortest path is longer than 390"),
    (["--grid-size", "4"], "--grid-size 4: a perfect maze needs a grid of at least 5x5"),
    (["--min-path-length", "150"], "--min-path-length 150 is above --max-path-length 140; swap them"),
    (["--min-path-length", "0"], "--min-path-length 0: a shortest path from S to G has length at least 1"),
    (["--train-samples", "0"], "--train-samples 0: each split needs at least 1 maze"),
    (["--length-distribution", "list"], "needs --length-values"),
    (["--length-distribution", "list", "--length-values", "10", "20", "--length-weights", "1"],
     "--length-weights has 1 values for 2 --length-values"),
    (["--length-distribution", "fixed", "--length-value", "300", "--grid-size", "21"],
     "--length-value 300 is impossible: a perfect maze on the 21x21 grid has 199 open cells"),
    (["--maze-mode", "random", "--wall-prob", "1"], "--wall-prob 1.0: a probability in [0, 1)"),
    # 4x4 cells: paths of 30 exist only in single-corridor mazes, which 2 mazes x 2 starts do not find.
    (["--grid-size", "9", "--length-distribution", "fixed", "--length-value", "30", "--max-grid-attempts", "2",
      "--max-start-attempts", "2"], "No 9x9 perfect maze with a shortest path of length 30 (train maze 1): "
                                    "2 mazes x 2 random starts tried"),
    # 2x2 cells: 8 mazes of S and G 6 apart in all, so the test split's first finds only duplicates.
    (["--grid-size", "5", "--length-distribution", "fixed", "--length-value", "6", "--train-samples", "8",
      "--test-samples", "1"], "50 lengths drawn in a row for test maze 1 gave duplicates of earlier mazes"),
], ids=["too-long", "grid-too-small", "min-above-max", "min-0", "no-samples", "list-without-values",
        "weights-mismatch", "fixed-too-long", "wall-prob-1", "attempts-exhausted", "only-duplicates"])
def test_errors_name_the_flag_and_the_fix(flags, message, tmp_path):
    with pytest.raises(SystemExit) as raised:
        build_data.main(["build-maze-unique", "--out", str(tmp_path / "out"), *flags])
    assert message in str(raised.value), str(raised.value)
