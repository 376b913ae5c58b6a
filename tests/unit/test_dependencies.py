"""Every package the diloco package imports is declared in pyproject.toml: ``pip install .``
alone gives a working install (the optional trainers under their extras)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Imported only where a feature needs them (the plug-ins; model=hf, which says so when it is
# missing), each under its own extra (pyproject's optional-dependencies).
EXTRAS = {"diloco/plugins/hf.py": "hf", "diloco/plugins/lightning.py": "lightning", "diloco/plugins/torchtitan.py": "torchtitan", "diloco/model.py": "hf"}


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_every_third_party_import_of_the_package_is_a_declared_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(r) for r in project["dependencies"]}
    extras = {k: {_requirement_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for f in sorted((ROOT / "diloco").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        allowed = declared | extras.get(EXTRAS.get(rel, ""), set())
        for module in sorted(_imports(f) - set(sys.stdlib_module_names) - {"diloco", "__future__"}):
            dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
            if not dists & allowed:
                missing.append(f"{rel} imports {module} (distribution {', '.join(sorted(dists))})")
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)


def test_every_package_of_the_source_tree_is_installed() -> None:
    """pyproject.toml lists the packages (the configs are installed as diloco.conf): a package
    missing there is missing from a non-editable install."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "diloco").rglob("__init__.py")}
    assert found - listed == set(), f"packages not in pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
