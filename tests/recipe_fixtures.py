"""The recipe tests' shared machinery (tests/test_recipes*.py: the presets as users run them, one
file per family so that the families train in parallel): the narrowing flags, the datasets that
build_data.py's command line builds from small source files, and the tests themselves, which
each file imports with its own RECIPES ({preset: (training steps, the least relative fall of the
mean loss)}). What is narrowed and why: test_recipes.py's docstring."""
import dataclasses
import math
import statistics

import pytest

import build_data
import data
import train
from tests.data_fixtures import arc_rule_files, maze_30x30_csv, sudoku_csv
from training.config import PRESETS, check_against_dataset, config_differences, parse_config

NARROW = ["--model.hidden-size", "64", "--model.num-heads", "1", "--model.puzzle-emb-ndim", "64",
          "--optim.global-batch-size", "8"]
WARMUP = ["--optim.lr-warmup-steps", "3"]  # a schedule choice (see test_recipes.py's docstring), not numerics
# The fields a tier run may change; every other field of the saved config equals the preset's.
NARROWED_FIELDS = {"model.hidden_size", "model.num_heads", "model.puzzle_emb_ndim", "model.num_puzzle_identifiers",
                   "optim.global_batch_size", "optim.lr_warmup_steps", "data.path", "run.dir"}
# EqR's presets have no puzzle embedding (their arch fixes puzzle_emb_ndim at 0): not narrowed.
UNNARROWED = {"eqr-sudoku": ("--model.puzzle-emb-ndim",), "eqr-maze": ("--model.puzzle-emb-ndim",)}
DATASETS = {"sudoku-mlp": "sudoku", "sudoku-att": "sudoku", "maze": "maze", "arc1": "arc1", "arc2": "arc2",
            "eqr-sudoku": "sudoku", "eqr-maze": "maze-unique", "urm-arc1": "arc1", "urm-arc2": "arc2",
            "urm-sudoku": "sudoku"}
"""The dataset each preset trains on here, as the real one: eqr-maze on EqR's Maze-Unique."""


def build_recipe_data(root, presets) -> dict[str, str]:
    """Dataset roots by preset (of `presets`), built under `root` by `python build_data.py build-*`
    from small source files: Sudoku-Extreme-like CSVs, 30x30 mazes (Maze-Hard's CSVs, and
    Maze-Unique's perfect mazes made by its builder), and hand-made ARC tasks on the 30x30 canvas.
    Test splits hold at most 8 examples: one evaluation batch. arc2 gets other tasks of the same
    shapes (so its graphs are arc1's: compiled once)."""
    sources, names = str(root), {DATASETS[preset] for preset in presets}
    out = {name: str(root / name) for name in names}
    if "sudoku" in names:
        build_data.main(["build-sudoku", "--out", out["sudoku"], "--num-aug", "3",
                         "--train-csv", sudoku_csv(f"{sources}/sudoku_train.csv", 40, seed=0),
                         "--test-csv", sudoku_csv(f"{sources}/sudoku_test.csv", 8, seed=1)])
    if "maze" in names:
        build_data.main(["build-maze", "--out", out["maze"], "--aug",
                         "--train-csv", maze_30x30_csv(f"{sources}/maze_train.csv", 16, seed=0),
                         "--test-csv", maze_30x30_csv(f"{sources}/maze_test.csv", 1, seed=1)])
    if "maze-unique" in names:
        build_data.main(["build-maze-unique", "--out", out["maze-unique"], "--train-samples", "128",
                         "--test-samples", "8"])
    for name, seed, training, evaluation in (("arc1", 0, ("flip", "recolour", "upscale", "border"), ("transpose",)),
                                             ("arc2", 1, ("transpose", "recolour", "upscale", "border"), ("flip",))):
        if name in names:
            directory = root / f"arc_source_{seed}"
            directory.mkdir()
            prefix = arc_rule_files(str(directory), seed, training, evaluation)
            build_data.main(["build-arc", "--out", out[name], "--input-prefix", prefix, "--subsets", "training",
                             "evaluation", "--num-aug", "7", "--seed", str(seed)])
    return {preset: out[DATASETS[preset]] for preset in presets}


def recipe_args(preset, path, run_dir, steps):
    left_out = UNNARROWED.get(preset, ())
    narrow = [arg for flag, value in zip(NARROW[::2], NARROW[1::2]) if flag not in left_out for arg in (flag, value)]
    return [preset, "--data.path", path, "--data.cache-dir", str(run_dir / "cache"), "--run.dir", str(run_dir / "run"),
            *narrow, *WARMUP, "--optim.max-steps", str(steps), "--run.log-every", "1"]


def pytest_generate_tests(metafunc):
    """`preset` runs over the importing file's RECIPES."""
    if "preset" in metafunc.fixturenames:
        metafunc.parametrize("preset", list(metafunc.module.RECIPES))


@pytest.fixture(scope="module")
def recipe_data(request, tmp_path_factory):
    """Dataset roots by preset of the importing file's RECIPES (build_recipe_data)."""
    return build_recipe_data(tmp_path_factory.mktemp("recipes"), request.module.RECIPES)


def test_recipe_trains_with_finite_falling_loss(preset, recipe_data, tmp_path, request):
    """Train `preset` narrowed for its steps: every logged loss finite, the mean loss of the last
    quarter of the steps at least its least fall (relative) below the first quarter's, and the
    final evaluation's metrics finite."""
    steps, least_fall = request.module.RECIPES[preset]
    result = train.main(parse_config(recipe_args(preset, recipe_data[preset], tmp_path, steps)))
    history = result["history"]
    assert [h["step"] for h in history] == list(range(1, steps + 1))
    not_finite = [(h["step"], h["lm_loss"], h["q_halt_loss"]) for h in history
                  if not (math.isfinite(h["lm_loss"]) and math.isfinite(h["q_halt_loss"]))]
    assert not not_finite, f"{preset}: non-finite losses (step, lm_loss, q_halt_loss): {not_finite[:5]}"
    losses = [h["loss"] for h in history]
    quarter = steps // 4
    first, last = statistics.mean(losses[:quarter]), statistics.mean(losses[-quarter:])
    assert last < (1 - least_fall) * first, f"{preset}: loss {first:.4f} -> {last:.4f}: {losses}"
    final = result["final"]
    assert final["count"] > 0 and all(math.isfinite(v) for v in final.values()), final


def test_recipe_numerics_are_the_presets(recipe_data, tmp_path):
    """The tier's overrides change widths, the batch and the warmup, nothing else: the saved
    config of a run equals the preset's in every other field (bfloat16 included)."""
    for preset, path in recipe_data.items():
        config = parse_config(recipe_args(preset, path, tmp_path / preset, 1))
        config = check_against_dataset(config, data.open_dataset(config.data.path, "train",
                                                                 config.data.cache_dir).metadata)
        preset_config = dataclasses.asdict(PRESETS[preset][1])
        changed = {line.split(":")[0] for line in config_differences(preset_config, dataclasses.asdict(config))}
        assert changed <= NARROWED_FIELDS, f"{preset}: {changed - NARROWED_FIELDS}"
        assert config.model.forward_dtype == "bfloat16" and config.optim.lr_warmup_steps == 3
