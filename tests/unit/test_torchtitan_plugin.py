"""diloco.plugins.torchtitan's parts that need no GPU: the config section as torchtitan's own
command line parses it, the checks of its fields, a torchtitan config made a site's, and a
rank's pipeline stages as one module keeping torchtitan's parameter names. (The Trainer itself
runs on a GPU only: scripts/gpu_check.sh; the CPU end-to-end test is tests/e2e/test_torchtitan.py.)

Skipped, naming what is missing, without torchtitan and its dependencies (the torchtitan extra)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(60)

try:
    from diloco.plugins import torchtitan as plugin
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)


def test_torchtitans_command_line_fills_the_diloco_section() -> None:
    from torchtitan.config import ConfigManager

    args = ["--module", "diloco.plugins.torchtitan", "--config", "llama3_debugmodel_diloco"]
    args += ["--diloco.coordinator", "10.0.0.1:50051", "--diloco.site-id", "eu-1", "--diloco.sync-every", "7", "--diloco.codec", "int8"]
    config = ConfigManager().parse_args(args)
    assert isinstance(config, plugin.DiLoCoTrainer.Config) and config._owner is plugin.DiLoCoTrainer
    assert (config.diloco.coordinator, config.diloco.site_id, config.diloco.sync_every, config.diloco.codec) == ("10.0.0.1:50051", "eu-1", 7, "int8")
    assert config.parallelism.spmd_backend == "partial_dtensor"  # DTensor parameters, which DiLoCo places
    assert config.model_spec.name == "llama3" and config.model_spec.flavor == "debugmodel"


def test_site_config_keeps_every_field_of_the_base() -> None:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    base = llama3_debugmodel()
    config = plugin.site_config(base, coordinator="h:1", site_id="a")
    assert config.training == base.training and config.model_spec is base.model_spec and config.optimizer == base.optimizer
    assert config.diloco == plugin.DiLoCoSiteConfig(coordinator="h:1", site_id="a")
    with pytest.raises(ValueError, match="Trainer.Config"):
        plugin.site_config(config)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"site_id": "a"}, "diloco.coordinator is empty"),
        ({"coordinator": "h:1"}, "site_id"),
        ({"coordinator": "h:1", "site_id": "a", "sync_every": 0}, "sync_every"),
        ({"coordinator": "h:1", "site_id": "a", "error_feedback_decay": 2.0}, "error_feedback_decay"),
    ],
)
def test_bad_fields_are_named_before_anything_is_built(fields: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        plugin.DiLoCoSiteConfig(**fields).check()
    plugin.DiLoCoSiteConfig(coordinator="h:1", site_id="a").check()


def test_a_ranks_pipeline_stages_are_one_module_with_torchtitans_names() -> None:
    from torchtitan.models.llama3 import llama3_configs

    with torch.device("meta"):
        whole = llama3_configs["debugmodel"](attn_backend="flex").build()
    names = [n for n, _ in whole.named_parameters()]

    def stage(keep: set[str]) -> torch.nn.Module:  # as torchtitan's pipeline split does: the other layers removed
        with torch.device("meta"):
            part = llama3_configs["debugmodel"](attn_backend="flex").build()
        for i in [k for k in part.layers if k not in keep]:
            del part.layers[i]
        if "0" not in keep:
            part.tok_embeddings = None
        if "5" not in keep:
            part.norm, part.lm_head = None, None
        return part

    first, last = stage({"0", "1", "2"}), stage({"3", "4", "5"})
    assert plugin.site_model([first]) is first
    parts = plugin.site_model([first, last])  # an interleaved schedule: two stages on one rank
    assert isinstance(parts, plugin.ModelParts)
    assert [n for n, _ in parts.named_parameters()] == [n for n, _ in first.named_parameters()] + [n for n, _ in last.named_parameters()]
    assert sorted(n for n, _ in parts.named_parameters()) == sorted(names)  # no prefix: the coordinator's names
    assert sum(p.numel() for p in parts.parameters()) == sum(p.numel() for p in whole.parameters())
    assert list(parts.children()) == []  # the parts stay the trainer's: not registered here
    with pytest.raises(ValueError, match="held by two model parts"):
        plugin.ModelParts([first, first])
