"""Hydra YAML files and Python schemas for EqR configuration."""
