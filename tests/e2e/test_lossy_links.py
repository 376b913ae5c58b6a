"""Lossy codecs on both links: sites stay bit-identical to the coordinator, and error
feedback keeps what was applied close to what the outer optimizer asked for."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import coordinator, push, theta

from diloco.codec import make_codec
from diloco.coordinator import CoordinatorConfig
from diloco.model import build_model, model_config
from diloco.outer import OuterConfig, apply_update, params_sha256
from diloco.wire import ChunkAssembler
from diloco.wire.chunks import encoded_bytes
from diloco.wire.fingerprint import fingerprint

THETA = theta({"w": (64, 40), "b": (40,)}, seed=5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["int8", "e3m0", "topk2bit+zstd"])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_downlink_error_feedback_and_bit_identity(codec: str, error_feedback: bool) -> None:
    rounds = 30
    # Outer SGD lr 1 without momentum: the proposed update is exactly −Δ, so we know it.
    coord = coordinator(
        THETA,
        CoordinatorConfig(total_rounds=rounds, codec_down=codec, error_feedback_down=error_feedback),
        outer=OuterConfig(lr=1.0, momentum=0.0, nesterov=False),
        sites=("s",),
    )
    site = {n: t.clone() for n, t in THETA.items()}
    g = torch.Generator().manual_seed(6)
    proposed_sum = {n: torch.zeros_like(t) for n, t in site.items()}
    for r in range(rounds):
        delta = {n: 1e-2 * torch.randn(t.shape, generator=g) for n, t in site.items()}
        push(coord, "s", r, delta, tokens=100)
        for n in delta:
            proposed_sum[n] -= delta[n]
        asm = ChunkAssembler(fingerprint(site))
        for c in coord.pull_update("s", r):
            assert c.codec == codec
            asm.add(c)
        apply_update(site, asm.finish())
        assert params_sha256(site) == coord.global_sha256()  # bit-identical every round
    applied = {n: site[n] - THETA[n] for n in site}
    gap = max(float((applied[n] - proposed_sum[n]).abs().max()) for n in site)
    one_step = max(float(d.abs().max()) for d in delta.values())
    if error_feedback:
        # With error feedback the total applied lags the total asked for by at most about one
        # update's quantization error, however many rounds have passed.
        assert gap <= 2 * one_step
    elif codec == "topk2bit+zstd":
        # Without it, a sparse downlink drops most of every update for good.
        assert gap > 3 * one_step


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("codec", "codec_down", "extra"),
    # every lossy codec on one link or the other (int8 has the in-process runs above, and
    # tests/e2e/test_streaming_sim.py's); topk2bit under recipe=sparse (the per-coordinate
    # average of what the sites sent)
    [("fp16", "int4", []), ("e3m0+zstd", "bf16", []), ("topk2bit", "topk2bit+zstd", ["recipe=sparse"])],
)
def test_multi_site_run_with_a_lossy_codec_keeps_sites_bit_identical(tmp_path: Path, codec: str, codec_down: str, extra: list[str]) -> None:
    sim = Path(sys.executable).parent / "diloco-sim"
    name, _, zstd = codec.partition("+")
    overrides = [
        "sites=2",
        "sync.every=2",
        "rounds=3",
        "data.batch_size=4",
        "eval_every=3",
        f"codec={name}",
        f"codec.zstd={bool(zstd)}",
        f"codec_down={codec_down}",
        "sim.plots=false",
        *extra,
    ]
    run = subprocess.run([str(sim), *overrides, f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["codec_down"].startswith(codec_down.partition("+")[0]) and summary["codec_down"].endswith("+zstd(level=3)") == codec_down.endswith("+zstd")
    assert summary["codec"].startswith(name) and summary["hashes_equal"]
    if "recipe=sparse" in extra:  # the recipe reached the processes: the coordinator averaged over senders
        assert json.loads((tmp_path / "config.json").read_text())["aggregate"] == "nonzero"
    workers = sorted((tmp_path / "workers").glob("*.json"))
    assert [w.stem for w in workers] == ["0", "1"]
    for w in workers:
        assert json.loads(w.read_text())["round_sha256"] == {str(m["round"]): m["global_sha256"] for m in metrics}
    # Each round's uplink is the encoded size: exactly the codec's formula (zstd: at most it),
    # and below 16 bits per value for every lossy codec.
    numels = [p.numel() for p in build_model(model_config("tiny"), seed=0).parameters()]
    formula = 2 * encoded_bytes(numels, codec=make_codec(codec))
    for m in metrics:
        assert m["bytes_up"] == formula if not zstd else m["bytes_up"] <= formula
        assert m["bytes_up"] <= 2.01 * summary["params"] * 2
