"""docs/tests.md's index names every test file (so a new one is placed by component)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_file_is_in_the_index() -> None:
    index = (ROOT / "docs" / "tests.md").read_text().split("## Every test file, by component", 1)[1]
    missing = [
        str(p.relative_to(ROOT))
        for tier in ("unit", "integration", "e2e")
        for p in sorted((ROOT / "tests" / tier).glob("test_*.py"))
        if f"`{p.stem}`" not in index
    ]
    assert not missing, f"not in docs/tests.md's index of test files: {missing}"
