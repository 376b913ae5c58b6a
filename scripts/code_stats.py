"""The longest files and functions of the diloco package (lines, generated stubs excluded).

.venv/bin/python scripts/code_stats.py [--top 5]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "diloco")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    files, funcs = [], []
    for f in sorted(args.root.rglob("*.py")):
        if "pb" in f.parts:
            continue
        text = f.read_text()
        rel = f.relative_to(args.root.parent)
        files.append((len(text.splitlines()), str(rel)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
    print(f"{len(files)} files, {sum(n for n, _ in files)} lines")
    print("longest files:")
    for n, name in sorted(files, reverse=True)[: args.top]:
        print(f"  {n:5d}  {name}")
    print("longest functions:")
    for n, name in sorted(funcs, reverse=True)[: args.top]:
        print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()
