"""docs/design.md follows the code: its layer table is scripts/check_layers.py's LAYERS, row by
row, and it names every package and top-level module of diloco/."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"


def check_layers_module():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layer_table_is_check_layers_py() -> None:
    layers = check_layers_module().LAYERS
    rows = re.findall(r"(?m)^\| (\d+) \| ((?:`[\w.]+`(?:, )?)+) \|", DESIGN.read_text())
    table = [(int(n), tuple(re.findall(r"`([\w.]+)`", packages))) for n, packages in rows]
    expected = [(i, tuple(layer)) for i, layer in enumerate(layers)]
    assert table == expected, f"docs/design.md's layer table differs from scripts/check_layers.py's LAYERS:\n doc:    {table}\n script: {expected}"


def test_every_package_and_module_is_named() -> None:
    text = DESIGN.read_text()
    pkg = ROOT / "diloco"
    missing = []
    for path in sorted(pkg.iterdir()):
        if path.name.startswith(("_", ".")) and path.name != "__init__.py":
            continue
        is_package = path.is_dir() and not path.is_symlink() and (path / "__init__.py").exists()
        if (is_package or path.suffix == ".py") and f"`{path.name}`" not in text:
            missing.append(f"`{path.name}`")
    if "`site/layouts`" not in text:
        missing.append("`site/layouts`")
    assert not missing, f"docs/design.md does not describe: {missing}"
