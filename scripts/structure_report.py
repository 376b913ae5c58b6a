"""The structure figures the project tracks between its structure steps (docs/design.md):
config keys, the largest classes and functions, the coordinator's and the site sync's size,
and the docs' lines per file.

    .venv/bin/python scripts/structure_report.py [--json]

Config keys are counted on conf/run.yaml as hydra composes it (the groups model, codec,
layout and init included): top-level keys and leaf keys. A class's size takes in its bases
defined in the package (a mixin's methods and fields count as the class's own): its lines,
methods and fields (distinct ``self.x = ...`` targets).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACKED = ("Coordinator", "OuterSync")


def config_keys() -> dict[str, int]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_container(compose(config_name="run"), resolve=True)

    def leaves(d: object) -> int:
        if isinstance(d, dict) and d:
            return sum(leaves(v) for v in d.values())
        return 1

    assert isinstance(cfg, dict)
    written = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "run.yaml"))
    assert isinstance(written, dict)
    written.pop("defaults", None)
    return {"top_level": len(cfg), "leaf": leaves(cfg), "run_yaml_top_level": len(written), "run_yaml_leaf": leaves(written)}


def _classes() -> dict[str, tuple[ast.ClassDef, int]]:
    out: dict[str, tuple[ast.ClassDef, int]] = {}
    for f in sorted((ROOT / "diloco").rglob("*.py")):
        if "pb" in f.parts:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (node, node.end_lineno - node.lineno + 1))  # type: ignore[operator]
    return out


def class_size(name: str, classes: dict[str, tuple[ast.ClassDef, int]]) -> dict[str, int]:
    """Lines, methods and fields of ``name`` with its package-defined bases."""
    seen, todo = [], [name]
    while todo:
        c = todo.pop()
        if c in classes and c not in seen:
            seen.append(c)
            todo += [b.id for b in classes[c][0].bases if isinstance(b, ast.Name)]
    lines, methods, fields = 0, 0, set()
    for c in seen:
        node, n = classes[c]
        lines += n
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                methods += 1
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                for t in targets:
                    for el in ast.walk(t):
                        if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                            fields.add(el.attr)
    return {"classes": len(seen), "lines": lines, "methods": methods, "fields": len(fields)}


def longest_functions(top: int) -> list[tuple[int, str]]:
    funcs = []
    for f in sorted((ROOT / "diloco").rglob("*.py")):
        if "pb" in f.parts:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{f.relative_to(ROOT)}:{node.lineno} {node.name}"))  # type: ignore[operator]
    return sorted(funcs, reverse=True)[:top]


def report() -> dict[str, object]:
    classes = _classes()
    biggest = sorted(((class_size(n, classes)["lines"], n) for n in classes), reverse=True)[:3]
    docs = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sorted((ROOT / "docs").rglob("*.md"))}
    docs["README.md"] = len((ROOT / "README.md").read_text().splitlines())
    return {
        "config_keys": config_keys(),
        "largest_classes": [{"name": n, **class_size(n, classes)} for _, n in biggest],
        "tracked": {n: class_size(n, classes) for n in TRACKED if n in classes},
        "longest_functions": [{"lines": n, "where": w} for n, w in longest_functions(3)],
        "docs_lines": docs,
        "docs_lines_total": sum(v for k, v in docs.items() if k.startswith("docs/")),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    r = report()
    if args.json:
        print(json.dumps(r, indent=1))
        return
    keys = r["config_keys"]
    print(
        f"config keys: conf/run.yaml as written {keys['run_yaml_top_level']} top-level, {keys['run_yaml_leaf']} leaf; composed with its groups {keys['top_level']} top-level, {keys['leaf']} leaf"
    )  # type: ignore[index]
    for c in r["largest_classes"]:  # type: ignore[attr-defined]
        print(f"largest class {c['name']}: {c['lines']} lines, {c['methods']} methods, {c['fields']} fields ({c['classes']} class(es))")
    for n, c in r["tracked"].items():  # type: ignore[attr-defined]
        print(f"{n}: {c['lines']} lines, {c['methods']} methods, {c['fields']} fields ({c['classes']} class(es))")
    for f in r["longest_functions"]:  # type: ignore[attr-defined]
        print(f"longest function {f['where']}: {f['lines']} lines")
    print(f"docs: {r['docs_lines_total']} lines in docs/ ({len(r['docs_lines']) - 1} files); README {r['docs_lines']['README.md']}")  # type: ignore[index]
    for k, v in r["docs_lines"].items():  # type: ignore[attr-defined]
        print(f"  {v:5d}  {k}")


if __name__ == "__main__":
    main()
