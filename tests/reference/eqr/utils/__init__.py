"""Utility package for EqR training, evaluation, and checkpoint helpers."""

__all__ = []
