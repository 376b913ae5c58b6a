"""Every configuration key is described once, on its dataclass field: conf/run.yaml and
docs/config.md's reference are generated from those (scripts/gen_config_doc.py) and must be
fresh; the process sections of conf/*.yaml are their dataclasses' fields with the same
defaults; every field of every documented dataclass has a doc."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from diloco.cli.config_doc import BEGIN, END, PROCESS_SECTIONS, default_of, process_keys, reference_markdown, run_sections, run_yaml
from diloco.observe.config import MetricsConfig
from diloco.observe.progress import ProgressConfig

ROOT = Path(__file__).resolve().parents[2]
STALE = "stale: run .venv/bin/python scripts/gen_config_doc.py"


def test_conf_run_yaml_is_generated_from_the_dataclasses() -> None:
    assert (ROOT / "conf" / "run.yaml").read_text() == run_yaml(), f"conf/run.yaml is {STALE}"


def test_docs_config_md_states_every_key_as_the_dataclasses_do() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    assert BEGIN in text and END in text
    section = BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
    assert section == reference_markdown(), f"docs/config.md's reference is {STALE}"


def test_every_key_of_the_run_has_a_doc() -> None:
    for name, cls in run_sections():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} ({name or 'top level'}) has no doc: give it one with diloco.fields.setting"


# The same sections in the other entry points' files (diloco-sim's metrics and status sections
# are its own: a port for the coordinator, 0 by default, checked by diloco.sim.sections).
CHECKED = [*PROCESS_SECTIONS, ("metrics", MetricsConfig, "site.yaml", {}), ("progress", ProgressConfig, "sim.yaml", {})]


@pytest.mark.parametrize(("section", "cls", "file", "renamed"), CHECKED, ids=[f"{s}@{f}" for s, _, f, _ in CHECKED])
def test_each_process_section_is_its_dataclass(section: str, cls: type, file: str, renamed: dict[str, str]) -> None:
    values = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / file))[section]  # type: ignore[index]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert process_keys(section, file) == list(values)
    for key, value in values.items():  # type: ignore[union-attr]
        name = renamed.get(key, key)
        assert name in fields, f"conf/{file}: {section}.{key} is not a field of {cls.__name__}"
        assert fields[name].metadata.get("doc"), f"{cls.__name__}.{name} has no doc"
        default = default_of(fields[name])
        assert value == default or (isinstance(default, float) and value == int(default)), (
            f"conf/{file}: {section}.{key}={value!r}, {cls.__name__} says {default!r}"
        )
