"""Hydra configs, installed as the package diloco.conf (see pyproject.toml)."""

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent  # the .yaml files, however the project is installed
