"""Writes conf/run.yaml and docs/config.md's reference of every key from the dataclasses whose
fields document them (diloco/cli/config_doc.py); tests/unit/test_config_doc.py fails when
either is stale.

    .venv/bin/python scripts/gen_config_doc.py
"""

from pathlib import Path

from diloco.cli.config_doc import BEGIN, END, reference_markdown, run_yaml

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    (ROOT / "conf" / "run.yaml").write_text(run_yaml())
    doc = ROOT / "docs" / "config.md"
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + reference_markdown() + tail)
    print(f"wrote {ROOT / 'conf' / 'run.yaml'} and {doc}")
