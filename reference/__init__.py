"""The reference implementation's formats: its checkpoints (weights.py: names, config from
shapes, loading), a model directory its own code evaluates (model_dir.py: export, what it cannot
express refused by name, reading it back) and that directory's model card (model_card.py)."""
