"""EqR's published recipes (eqr-*) as users run them, by test_recipes.py's rules: narrowed widths
and batch, the preset's numerics and arch (its damped, noisy updates and fresh initial draws;
no puzzle embedding to narrow), on datasets built by build_data.py's command line (eqr-maze on
Maze-Unique, built by its builder). Every logged loss finite, the loss falling."""
from tests.recipe_fixtures import (  # noqa: F401 - the tests and their fixture, run over RECIPES
    pytest_generate_tests,
    recipe_data,
    test_recipe_numerics_are_the_presets,
    test_recipe_trains_with_finite_falling_loss,
)

# preset: (training steps, the least relative fall of the mean loss; test_recipes.py's RECIPES).
# eqr-sudoku is TRM-MLP's network: as slow to learn at width 64 (its steps and fall are
# sudoku-mlp's); eqr-maze's attention falls ~22% in 16 steps on Maze-Unique.
RECIPES = {
    "eqr-sudoku": (128, 0.015),
    "eqr-maze": (16, 0.05),
}

