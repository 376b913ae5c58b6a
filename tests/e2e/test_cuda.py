"""A site's training on a CUDA GPU: the inner trainer in bf16 on the device, the outer sync
between the GPU model and the site's copy of θ on the host, and a whole diloco-sim run with
two sites sharing one GPU, every site's θ bit-identical to the coordinator's after every round.

Skipped without a CUDA GPU. DILOCO_TEST_CUDA_ON_CPU=1 runs the same tests on the CPU (a dry
run of their logic: the checks that only mean something on a GPU, pinned host memory and
fused AdamW, are left out, and the simulation runs without device=cuda).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from helpers import run_sim

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.model import build_model, model_config
from diloco.outer import OuterConfig, params_sha256
from diloco.site.exchange import Timeouts
from diloco.site.inner import InnerConfig, InnerTrainer
from diloco.site.outer_sync import OuterSync, SyncOptions
from diloco.transport import CoordinatorClient, serve

DRY = os.environ.get("DILOCO_TEST_CUDA_ON_CPU") == "1"
DEVICE = "cpu" if DRY else "cuda"
ON_GPU = DEVICE == "cuda"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not DRY and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = model_config("tiny", context=64, d_model=64, n_layers=2, n_heads=2, mlp_hidden=176)


def _counting_batch(batch: int, context: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that count up by one from a random start (mod 256): the next token is always the
    current one + 1, a rule a model learns within a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 256, (batch, 1), generator=g)
    seq = (start + torch.arange(context + 1)) % 256
    return seq[:, :-1].to(DEVICE), seq[:, 1:].to(DEVICE)


def _matmul_dtypes(model: torch.nn.Module) -> tuple[list[torch.dtype], object]:
    """The output dtypes of the model's first Linear, as the forward passes run (a hook)."""
    seen: list[torch.dtype] = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    handle = linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen, handle


# ---- the inner trainer on the device ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_inner_trainer_bf16_steps_on_the_gpu() -> None:
    model = build_model(MODEL, seed=0).to(DEVICE)
    trainer = InnerTrainer(model, InnerConfig(lr=3e-3, warmup_steps=0, bf16=True), total_steps=40)
    x, y = _counting_batch(16, MODEL.context)

    # The same weights and batch in float32 on the CPU: the first bf16 loss is close to it.
    reference = build_model(MODEL, seed=0)
    with torch.no_grad():
        from diloco.model import lm_loss

        ref_loss = float(lm_loss(reference(x.cpu()), y.cpu()))

    seen, handle = _matmul_dtypes(model)
    try:
        losses = [trainer.step(x, y) for _ in range(40)]
    finally:
        handle.remove()
    assert all(math.isfinite(v) for v in losses), losses
    assert abs(losses[0] - ref_loss) < 0.05, (losses[0], ref_loss)
    assert losses[-1] < losses[0] - 1.0, losses  # it learned the counting rule (ln 256 = 5.55 at the start)
    # Autocast was active on the model's device: the matmuls ran in bf16 ...
    assert seen and set(seen) == {torch.bfloat16}, seen
    # ... while the parameters (and so θ, Δ and the hashes) stay float32 on the device.
    for name, p in model.named_parameters():
        assert p.device.type == DEVICE and p.dtype == torch.float32, (name, p.device, p.dtype)
    for state in trainer.optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                assert v.device.type == DEVICE, v.device


@pytest.mark.timeout(60)
@pytest.mark.skipif(not ON_GPU, reason="fused AdamW: CUDA only")
def test_inner_optimizer_is_fused_on_cuda() -> None:
    model = build_model(MODEL, seed=0).to(DEVICE)
    trainer = InnerTrainer(model, InnerConfig(), total_steps=10)
    assert trainer.optimizer.defaults.get("fused") is True, trainer.optimizer.defaults


# ---- the outer sync with the model on the device ------------------------------------------------


@pytest.mark.timeout(120)
def test_outer_sync_round_trips_a_gpu_model() -> None:
    """One site, outer SGD with lr 1 and no momentum: after each round θ is the site's
    trained weights (so Δ was taken from the GPU model correctly), the site's copy of θ is
    bit-identical to the coordinator's, lives on the host (pinned, for a GPU model), and the
    model holds exactly θ again, still on its device."""
    rounds, steps = 2, 5
    theta0 = dict(build_model(MODEL, seed=0).named_parameters())
    coord = Coordinator(theta0, OuterConfig(name="SGD", lr=1.0, momentum=0.0, nesterov=False), CoordinatorConfig(total_rounds=rounds, min_sites=1))
    server, port = serve(coord, "127.0.0.1", 0)
    try:
        model = build_model(MODEL, seed=1).to(DEVICE)  # another init: joining must load θ₀ over it
        trainer = InnerTrainer(model, InnerConfig(lr=3e-3, warmup_steps=0, bf16=True), total_steps=rounds * steps)
        x, y = _counting_batch(8, MODEL.context, seed=3)
        with CoordinatorClient(f"127.0.0.1:{port}", timeout_s=60) as client:
            sync = OuterSync(model, client, "0", SyncOptions.of(timeouts=Timeouts(wait_poll_s=5.0, round_timeout_s=60.0)))
            try:
                sync.join()
                _assert_model_holds(model, coord.global_params())
                _assert_host_copy(sync)
                for r in range(rounds):
                    loss = 0.0
                    for _ in range(steps):
                        loss = trainer.step(x, y)
                    local = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
                    assert params_sha256(local) != coord.global_sha256()  # the model moved away from θ
                    digest = sync.sync(tokens=steps * x.numel(), train_loss=loss, inner_steps=steps)
                    assert digest == sync.global_sha256() == coord.global_sha256() == sync.stats.round_hashes[r]
                    theta = coord.global_params()
                    diff = max(float((theta[n] - local[n]).abs().max()) for n in local)
                    assert diff <= 1e-6, (r, diff)
                    _assert_model_holds(model, theta)
                    _assert_host_copy(sync)
                assert sync.finished
                sync.leave()
            finally:
                sync.close()
    finally:
        server.stop(grace=None).wait(5)
    assert coord.committed_rounds == rounds


def _assert_model_holds(model: torch.nn.Module, theta: dict[str, torch.Tensor]) -> None:
    named = dict(model.named_parameters())
    assert named.keys() == theta.keys()
    for n, p in named.items():
        assert p.device.type == DEVICE, (n, p.device)
        assert torch.equal(p.detach().cpu(), theta[n].cpu()), n  # bit for bit


def _assert_host_copy(sync: OuterSync) -> None:
    for n, t in sync.global_params.items():
        assert t.device.type == "cpu", (n, t.device)  # costs no GPU memory
        if ON_GPU:
            assert t.is_pinned(), n  # so the copies to and from the GPU are asynchronous DMA


# ---- the DiLoCo API: a user loop around a compiled model on the device ---------------------------


@pytest.mark.timeout(240)
def test_user_loop_with_a_compiled_model_stays_bit_identical() -> None:
    """A plain loop with ``torch.compile(model)`` on the device and ``with DiLoCo(...)``: the
    compiled wrapper is seen through (its ``_orig_mod.`` prefix dropped), the steps run
    compiled, and after every round the model holds the coordinator's θ bit for bit."""
    from diloco import DiLoCo

    rounds, steps = 2, 4
    theta0 = dict(build_model(MODEL, seed=0).named_parameters())
    coord = Coordinator(theta0, OuterConfig(name="SGD", lr=0.7, momentum=0.9, nesterov=True), CoordinatorConfig(total_rounds=rounds, min_sites=1))
    server, port = serve(coord, "127.0.0.1", 0)
    try:
        model = build_model(MODEL, seed=1).to(DEVICE)
        compiled = torch.compile(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x, y = _counting_batch(8, MODEL.context, seed=3)
        seen = []
        with DiLoCo(compiled, optimizer, coordinator=f"127.0.0.1:{port}", site_id="0", sync_every=steps) as dl:
            _assert_model_holds(model, coord.global_params())
            while not dl.finished:
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=ON_GPU):
                    logits = compiled(x)
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss.backward()
                dl.record_loss(loss, tokens=x.numel())
                before = dl.round
                optimizer.step()
                optimizer.zero_grad()
                if dl.round != before:
                    _assert_model_holds(model, coord.global_params())
                    seen.append(coord.global_sha256())
        assert dl.global_sha256() == coord.global_sha256() == seen[-1] and len(seen) == rounds
    finally:
        server.stop(grace=None).wait(5)


# ---- diloco-sim: two sites on one GPU ----------------------------------------------------------


@pytest.mark.timeout(300)
def test_two_sites_share_one_gpu_bit_identical(tmp_path: Path) -> None:
    sites, h, rounds = 2, 10, 3
    overrides = [
        "mode=diloco", f"sites={sites}", "model=tiny", f"sync.every={h}", f"rounds={rounds}", "data.batch_size=16",
        "eval_every=3", "inner.bf16=true", "sim.timeout_s=240",
    ]  # fmt: skip
    if ON_GPU:
        overrides.append("device=cuda")
    run = run_sim(tmp_path / "run", *overrides, timeout=280)
    assert run.returncode == 0, run.describe()

    config = run.json("config.json")
    assert config["inner"]["bf16"] is True
    if ON_GPU:
        assert config["device"] == "cuda", config.get("device")

    summary, metrics = run.summary, run.metrics
    assert summary["hashes_equal"] is True, run.describe()
    assert summary["rounds_committed"] == rounds
    assert [m["round"] for m in metrics] == list(range(rounds))
    workers = run.workers()
    assert sorted(workers) == [str(s) for s in range(sites)]
    for site_id, w in workers.items():
        # Every site's copy of θ equals the coordinator's after EVERY round.
        assert sorted(w["round_sha256"], key=int) == [str(r) for r in range(rounds)], (site_id, w["round_sha256"])
        for m in metrics:
            assert w["round_sha256"][str(m["round"])] == m["global_sha256"], (site_id, m["round"])
        assert w["global_sha256"] == summary["global_sha256"]
        if ON_GPU and "device" in w:  # where the site says where it trained
            assert str(w["device"]).startswith("cuda"), w["device"]

    losses = [m["train_loss"] for m in metrics]
    assert all(isinstance(v, float) and math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert math.isfinite(summary["final_eval_bpb"]) and summary["final_eval_bpb"] < 8.0
