"""EqR's published recipes (eqr-*) as users run them, by test_recipes.py's rules: narrowed widths
and batch, the preset's numerics and arch (its damped, noisy updates and fresh initial draws;
no puzzle embedding to narrow), on datasets built by build_data.py's command line (eqr-maze on
Maze-Unique, built by its builder). Every logged loss finite, the loss falling."""
import pytest

from tests.recipe_fixtures import build_recipe_data, numerics_are_the_presets, trains_with_finite_falling_loss

# preset: (training steps, the least relative fall of the mean loss; test_recipes.py's RECIPES).
# eqr-sudoku is TRM-MLP's network: as slow to learn at width 64 (its steps and fall are
# sudoku-mlp's); eqr-maze's attention falls ~22% in 16 steps on Maze-Unique.
RECIPES = {
    "eqr-sudoku": (128, 0.015),
    "eqr-maze": (16, 0.05),
}


@pytest.fixture(scope="module")
def recipe_data(tmp_path_factory):
    return build_recipe_data(tmp_path_factory.mktemp("recipes"), RECIPES)


@pytest.mark.parametrize("preset", list(RECIPES))
def test_recipe_trains_with_finite_falling_loss(preset, recipe_data, tmp_path):
    trains_with_finite_falling_loss(preset, recipe_data[preset], tmp_path, *RECIPES[preset])


def test_recipe_numerics_are_the_presets(recipe_data, tmp_path):
    numerics_are_the_presets(recipe_data, tmp_path)
