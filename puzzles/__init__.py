"""The puzzles themselves: ARC's grids, augmentations and evaluator (arc.py) and its dataset
builder (build_arc.py, byte for byte the reference's), the Sudoku, Maze and demo builders and the
puzzles' text format (builders.py), EqR's Maze-Unique generated locally (maze_unique.py, maze for
maze EqR's builder's). build_data.py is their command line."""
