"""Hydra configs, installed as the package diloco.conf (see pyproject.toml)."""
