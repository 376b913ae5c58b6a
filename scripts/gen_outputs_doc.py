"""Writes docs/outputs.md from the typed records of diloco/app/records.py.

.venv/bin/python scripts/gen_outputs_doc.py
"""

from pathlib import Path

from diloco.app.records import outputs_markdown

if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "docs" / "outputs.md"
    path.write_text(outputs_markdown())
    print(f"wrote {path}")
