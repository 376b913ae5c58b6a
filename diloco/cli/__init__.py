"""Hydra entry points (the only modules that import hydra)."""
