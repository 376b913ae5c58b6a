"""sync.preset=hide_link (diloco.app.preset): diloco-plan's model chooses the sync keys and
codecs for the run's link. Pinned to the setting docs/streaming.md measured best: model=small,
H = 50, 4 sites, 10 rounds, a 0.41 s step at 10 Mbit/s and 100 ms gives F = 5, τ = 5, merge=ahead,
balanced fragments frozen at their last push, an int8 uplink and an int4 downlink."""

from __future__ import annotations

import pytest

from diloco.app.config import run_config_from_dict
from diloco.app.preset import apply_preset
from diloco.sync import FragmentEnd, FragmentSplit, Merge, Preset


def _cfg(**sync: object) -> object:
    return run_config_from_dict({"model": {"name": "small"}, "sync": {"preset": "hide_link", "step_s": 0.41, **sync}})


def test_the_measured_best_at_10_mbit_is_what_the_preset_chooses() -> None:
    said: list[str] = []
    cfg = apply_preset(_cfg(link_mbit=10, link_rtt_ms=100), log=said.append)
    s = cfg.sync
    assert (s.fragments, s.overlap, s.merge, s.split, s.end) == (5, 5, Merge.AHEAD, FragmentSplit.BALANCED, FragmentEnd.FREEZE)
    assert (cfg.codec.name, cfg.downlink_codec.name) == ("int8", "int4")
    assert (s.preset, s.link_mbit, s.link_rtt_ms, s.step_s) == (Preset.HIDE_LINK, 10, 100, 0.41)  # what config.json records
    assert "sync.fragments=5 sync.overlap=5" in said[0] and "predicted utilization" in said[0]


def test_a_link_that_hides_itself_keeps_blocking_diloco_and_int8() -> None:
    cfg = apply_preset(_cfg(link_mbit=10_000, link_rtt_ms=1), log=lambda _m: None)
    assert (cfg.sync.fragments, cfg.sync.overlap, cfg.codec.name) == (1, 0, "int8")


def test_keys_set_by_hand_stay_and_the_search_keeps_them() -> None:
    cfg = apply_preset(_cfg(link_mbit=10, link_rtt_ms=100, fragments=2), log=lambda _m: None)
    assert cfg.sync.fragments == 2 and cfg.sync.overlap > 0
    cfg = apply_preset(
        run_config_from_dict(
            {
                "model": {"name": "small"},
                "codec": "int4",
                "codec_down": "int8",
                "sync": {"preset": "hide_link", "step_s": 0.41, "link_mbit": 10, "link_rtt_ms": 100},
            }
        ),
        log=lambda _m: None,
    )
    assert (cfg.codec.name, cfg.downlink_codec.name) == ("int4", "int8")


def test_the_preset_needs_the_link_and_a_coordinator_the_step_time() -> None:
    with pytest.raises(ValueError, match="needs the link: sync.link_mbit and sync.link_rtt_ms"):
        apply_preset(_cfg())
    with pytest.raises(ValueError, match="needs sync.step_s here"):
        apply_preset(run_config_from_dict({"sync": {"preset": "hide_link", "link_mbit": 10, "link_rtt_ms": 100}}), measure=False)


def test_no_preset_changes_nothing() -> None:
    cfg = run_config_from_dict({"model": {"name": "small"}})
    assert apply_preset(cfg) is cfg
