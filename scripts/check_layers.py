"""Prints every import inside the diloco package that points from a lower layer to a higher
one (or sideways, between two packages of one layer), and every module no layer claims.
Exit status 1 if there is any. The layers, bottom to top, follow the data path:

    .venv/bin/python scripts/check_layers.py          # the violations (none expected)
    .venv/bin/python scripts/check_layers.py --graph  # every package -> the packages it imports
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

# Bottom to top. A module may import its own package and anything in a lower layer.
LAYERS: list[tuple[str, ...]] = [
    ("diloco.fields",),  # configuration fields that carry their own documentation
    (
        "diloco.boxes",
        "diloco.io",
        "diloco.run_dir",
        "diloco.errors",
        "diloco.security",
        "diloco.plan",
    ),  # leaves: tensor slices, files, a run directory's paths, refusal kinds, credentials, the bandwidth planner
    ("diloco.types", "diloco.model_config"),  # the domain types that cross the wire; what model a run trains
    ("diloco.observe",),  # watching a run: the log format, exporters, plots of a run directory
    ("diloco.outer", "diloco.codec", "diloco.model", "diloco.data", "diloco.checkpoint"),  # math, value codecs, model, data
    ("diloco.sync",),  # the sync section, the run's rounds in steps, the settings every site shares
    ("diloco.wire",),  # framing: tensors <-> chunks, model fingerprints
    ("diloco.transport",),  # the only package that imports grpc
    ("diloco.coordinator", "diloco.site"),  # the two ends of the protocol
    ("diloco.api",),  # DiLoCo: a user's own loop as a site
    ("diloco.plugins",),  # trainer plug-ins over the API
    ("diloco.app",),  # process mains, the run config, the run directory's records
    ("diloco.sim",),  # the local simulation and its fault injection
    ("diloco.cli",),  # hydra entry points
    ("diloco",),  # the package's lazy front door
]


def package_of(module: str) -> str | None:
    """The layer entry that owns ``module`` (the longest matching prefix)."""
    best = None
    for layer in LAYERS:
        for p in layer:
            if (module == p or p != "diloco" and module.startswith(p + ".")) and (best is None or len(p) > len(best)):
                best = p
    return best


def layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def imports(root: Path) -> dict[str, set[str]]:
    """module -> the diloco modules it imports (at any depth in the file, lazy imports too)."""
    out: dict[str, set[str]] = defaultdict(set)
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        module = ".".join(parts)
        here = parts if is_pkg else parts[:-1]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] if node.module or not node.level else [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out[module].update(n for n in names if n == "diloco" or n.startswith("diloco."))
    return out


def violations(root: Path) -> list[str]:
    found = []
    for module, targets in sorted(imports(root).items()):
        if ".pb." in module + ".":
            continue  # generated stubs
        src = package_of(module)
        if src is None:
            found.append(f"{module}: in no layer")
            continue
        for t in sorted(targets):
            dst = package_of(t)
            if dst is None or dst == src or t == "diloco" and src == "diloco":
                continue
            if layer_of(dst) > layer_of(src):
                found.append(f"{module} -> {t}: up (layer {layer_of(src)} imports layer {layer_of(dst)})")
            elif layer_of(dst) == layer_of(src):
                found.append(f"{module} -> {t}: sideways (both layer {layer_of(src)})")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "diloco")
    p.add_argument("--graph", action="store_true", help="print package -> imported packages")
    args = p.parse_args()
    if args.graph:
        graph: dict[str, set[str]] = defaultdict(set)
        for module, targets in imports(args.root).items():
            src = package_of(module) or module
            graph[src].update((package_of(t) or t) for t in targets if (package_of(t) or t) != src)
        for src in sorted(graph):
            print(f"{src} -> {', '.join(sorted(graph[src]))}")
        return 0
    found = violations(args.root)
    for line in found:
        print(line)
    print(f"{len(found)} import(s) against the layers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
