"""The paper's recipes as users run them, and URM's (urm-*): every preset but demo, in its own
numerics and arch, trained for some steps through parse_config/train.main on a dataset that
build_data.py's command line builds from small source files. Every logged loss must be finite and the loss must fall.

Only widths and the batch are narrowed for the CPU:
  hidden_size 512 -> 64 and num_heads 8 -> 1 (the head width stays 64, so RoPE's frequencies and
  the attention's scale are the preset's), puzzle_emb_ndim 512 -> 64 (still one prefix row of
  puzzle_emb_len 16; URM's ceil(ndim / width) is 1 at both widths), global batch 768 (urm-sudoku's
  128) -> 8 (one row per virtual device: attention over 916 positions is the costly part).
Kept: bfloat16 activations, the arch (urm: its ConvSwiGLU), mlp_t / pos_encodings, H_cycles,
L_cycles, L_layers, expansion, puzzle_emb_len, halt_max_steps and exploration, the optimizer
(urm-arc2: Muon), lr and puzzle-embedding lr, weight decays, betas, EMA rate
(test_recipe_numerics_are_the_presets checks the saved config field by field).
The one schedule change: lr_warmup_steps 2000 -> 3, or lr would stay near 0 for the whole run.

With the stablemax of before 71973c6 (its unused 1/(1-x) branch overflowing at bf16 logits of
exactly 1.0) every one of these runs logs a NaN loss from step 2 on.
"""
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
WARMUP = ["--optim.lr-warmup-steps", "3"]  # a schedule choice (see the module docstring), not numerics
# The fields a tier run may change; every other field of the saved config equals the preset's.
NARROWED_FIELDS = {"model.hidden_size", "model.num_heads", "model.puzzle_emb_ndim", "model.num_puzzle_identifiers",
                   "optim.global_batch_size", "optim.lr_warmup_steps", "data.path", "run.dir"}

# preset: (training steps, the least relative fall of the mean loss from the first quarter of the
# steps to the last). All rows of a batch run their 16 ACT segments together, so 16 steps train
# every row to halt_max_steps. At width 64 and the paper's lr, TRM-MLP learns slowly: its loss
# falls ~3% in 128 steps (and moves ~1% without learning, at lr 0), the attention presets' 15-30%
# in 16-32 steps. URM's ARC recipes apply 48 blocks per ACT step, 24 of them with backward (arc1's
# TRM: 30 and 10): 8 steps cost about what arc1's 16 do; urm-arc1's loss falls ~13% in them, and
# urm-arc2's, with Muon at the same lr, 2.4% (2.738 -> 2.665, lower at every step).
RECIPES = {
    "sudoku-mlp": (128, 0.015),
    "sudoku-att": (32, 0.05),
    "maze": (16, 0.05),
    "arc1": (16, 0.05),
    "arc2": (16, 0.05),
    "eqr-sudoku": (128, 0.015),
    "eqr-maze": (16, 0.05),
    "urm-arc1": (8, 0.05),
    "urm-arc2": (8, 0.015),
    "urm-sudoku": (32, 0.05),
}
# EqR's presets have no puzzle embedding (their arch fixes puzzle_emb_ndim at 0): not narrowed.
UNNARROWED = {"eqr-sudoku": ("--model.puzzle-emb-ndim",), "eqr-maze": ("--model.puzzle-emb-ndim",)}


@pytest.fixture(scope="module")
def recipe_data(tmp_path_factory):
    """Dataset roots by preset, built by `python build_data.py build-*` from small source files:
    Sudoku-Extreme-like CSVs, 30x30 mazes, and hand-made ARC tasks on the 30x30 canvas. Test
    splits hold at most 8 examples: one evaluation batch. arc2 gets other tasks of the same
    shapes (so its graphs are arc1's: compiled once)."""
    root = tmp_path_factory.mktemp("recipes")
    sources = str(root)
    sudoku, maze, arc1, arc2 = (str(root / name) for name in ("sudoku", "maze", "arc1", "arc2"))
    build_data.main(["build-sudoku", "--out", sudoku, "--num-aug", "3",
               "--train-csv", sudoku_csv(f"{sources}/sudoku_train.csv", 40, seed=0),
               "--test-csv", sudoku_csv(f"{sources}/sudoku_test.csv", 8, seed=1)])
    build_data.main(["build-maze", "--out", maze, "--aug",
               "--train-csv", maze_30x30_csv(f"{sources}/maze_train.csv", 16, seed=0),
               "--test-csv", maze_30x30_csv(f"{sources}/maze_test.csv", 1, seed=1)])
    for out, seed, training, evaluation in ((arc1, 0, ("flip", "recolour", "upscale", "border"), ("transpose",)),
                                            (arc2, 1, ("transpose", "recolour", "upscale", "border"), ("flip",))):
        directory = root / f"arc_source_{seed}"
        directory.mkdir()
        prefix = arc_rule_files(str(directory), seed, training, evaluation)
        build_data.main(["build-arc", "--out", out, "--input-prefix", prefix, "--subsets", "training", "evaluation",
                   "--num-aug", "7", "--seed", str(seed)])
    # eqr-maze trains on EqR's Maze-Unique (perfect mazes, no builder here): Maze-Hard's format and shapes
    return {"sudoku-mlp": sudoku, "sudoku-att": sudoku, "maze": maze, "arc1": arc1, "arc2": arc2,
            "eqr-sudoku": sudoku, "eqr-maze": maze, "urm-arc1": arc1, "urm-arc2": arc2, "urm-sudoku": sudoku}


def recipe_args(preset, path, run_dir, steps):
    left_out = UNNARROWED.get(preset, ())
    narrow = [arg for flag, value in zip(NARROW[::2], NARROW[1::2]) if flag not in left_out for arg in (flag, value)]
    return [preset, "--data.path", path, "--data.cache-dir", str(run_dir / "cache"), "--run.dir", str(run_dir / "run"),
            *narrow, *WARMUP, "--optim.max-steps", str(steps), "--run.log-every", "1"]


@pytest.mark.parametrize("preset", list(RECIPES))
def test_recipe_trains_with_finite_falling_loss(preset, recipe_data, tmp_path):
    steps, least_fall = RECIPES[preset]
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
    for preset in RECIPES:
        config = parse_config(recipe_args(preset, recipe_data[preset], tmp_path / preset, 1))
        config = check_against_dataset(config, data.open_dataset(config.data.path, "train",
                                                                        config.data.cache_dir).metadata)
        preset_config = dataclasses.asdict(PRESETS[preset][1])
        changed = {line.split(":")[0] for line in config_differences(preset_config, dataclasses.asdict(config))}
        assert changed <= NARROWED_FIELDS, f"{preset}: {changed - NARROWED_FIELDS}"
        assert config.model.forward_dtype == "bfloat16" and config.optim.lr_warmup_steps == 3
