"""The paper's recipes as users run them: every TRM preset but demo, in its own numerics and arch,
trained for some steps through parse_config/train.main on a dataset that build_data.py's command
line builds from small source files (tests/recipe_fixtures.py). Every logged loss must be finite
and the loss must fall. The successors' presets, by the same rules: test_recipes_eqr.py,
test_recipes_urm.py (one file per family, so that the families train in parallel).

Only widths and the batch are narrowed for the CPU:
  hidden_size 512 -> 64 and num_heads 8 -> 1 (the head width stays 64, so RoPE's frequencies and
  the attention's scale are the preset's), puzzle_emb_ndim 512 -> 64 (still one prefix row of
  puzzle_emb_len 16; URM's ceil(ndim / width) is 1 at both widths; EqR has no puzzle embedding),
  global batch 768 (urm-sudoku's 128) -> 8 (one row per virtual device: attention over 916
  positions is the costly part).
Kept: bfloat16 activations, the arch (urm: its ConvSwiGLU; eqr: its damped noisy updates), mlp_t /
pos_encodings, H_cycles, L_cycles, L_layers, expansion, puzzle_emb_len, halt_max_steps and
exploration, the optimizer (urm-arc2: Muon), lr and puzzle-embedding lr, weight decays, betas, EMA
rate (each file's numerics test checks the saved config field by field).
The one schedule change: lr_warmup_steps 2000 -> 3, or lr would stay near 0 for the whole run.

With the stablemax of before 71973c6 (its unused 1/(1-x) branch overflowing at bf16 logits of
exactly 1.0) every one of these runs logs a NaN loss from step 2 on.
"""
from tests.recipe_fixtures import (  # noqa: F401 - the tests and their fixture, run over RECIPES
    pytest_generate_tests,
    recipe_data,
    test_recipe_numerics_are_the_presets,
    test_recipe_trains_with_finite_falling_loss,
)

# preset: (training steps, the least relative fall of the mean loss from the first quarter of the
# steps to the last). All rows of a batch run their 16 ACT segments together, so 16 steps train
# every row to halt_max_steps. At width 64 and the paper's lr, TRM-MLP learns slowly: its loss
# falls ~3% in 128 steps (and moves ~1% without learning, at lr 0), the attention presets' 15-30%
# in 16-32 steps.
RECIPES = {
    "sudoku-mlp": (128, 0.015),
    "sudoku-att": (32, 0.05),
    "maze": (16, 0.05),
    "arc1": (16, 0.05),
    "arc2": (16, 0.05),
}



def test_every_preset_but_demo_has_a_recipe_test():
    from tests import test_recipes_eqr, test_recipes_urm
    from training.config import PRESETS

    tested = [*RECIPES, *test_recipes_eqr.RECIPES, *test_recipes_urm.RECIPES]
    assert sorted(tested) == sorted(set(PRESETS) - {"demo"})
