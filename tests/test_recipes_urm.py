"""URM's published recipes (urm-*) as users run them, by test_recipes.py's rules: narrowed widths
and batch, the preset's numerics and arch (its ConvSwiGLU, one hidden state, truncated
backpropagation; urm-arc2's Muon), on datasets built by build_data.py's command line. Every
logged loss finite, the loss falling."""
from tests.recipe_fixtures import (  # noqa: F401 - the tests and their fixture, run over RECIPES
    pytest_generate_tests,
    recipe_data,
    test_recipe_numerics_are_the_presets,
    test_recipe_trains_with_finite_falling_loss,
)

# preset: (training steps, the least relative fall of the mean loss; test_recipes.py's RECIPES).
# URM's ARC recipes apply 48 blocks per ACT step, 24 of them with backward (arc1's TRM: 30 and
# 10): 8 steps cost about what arc1's 16 do; urm-arc1's loss falls ~13% in them, and urm-arc2's,
# with Muon at the same lr, 2.4% (2.738 -> 2.665, lower at every step). urm-arc2's tasks have
# urm-arc1's shapes: its graphs but the optimizer's are compiled once, in this file's process.
RECIPES = {
    "urm-arc1": (8, 0.05),
    "urm-arc2": (8, 0.015),
    "urm-sudoku": (32, 0.05),
}

