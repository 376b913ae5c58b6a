"""The inner trainer: schedule, clipping, bf16 autocast, and bits-per-byte evaluation."""

import math
import threading

import pytest
import torch

from diloco.model import build_model, lm_loss, model_config
from diloco.site.device import flush_denormals
from diloco.site.inner import InnerConfig, InnerTrainer, evaluate_bpb, lr_factor

pytestmark = pytest.mark.timeout(60)
MODEL = model_config("tiny", context=16, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64)


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor() -> None:
    cfg = InnerConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, 110, cfg) == pytest.approx(0.1)
    assert lr_factor(9, 110, cfg) == pytest.approx(1.0)
    assert lr_factor(10, 110, cfg) == pytest.approx(1.0)
    assert lr_factor(60, 110, cfg) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_factor(110, 110, cfg) == pytest.approx(0.1)
    assert lr_factor(500, 110, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("bf16", [False, True])
def test_steps_lower_the_loss_and_follow_the_schedule(bf16: bool) -> None:
    torch.manual_seed(0)
    model = build_model(MODEL, seed=0)
    trainer = InnerTrainer(model, InnerConfig(lr=1e-2, warmup_steps=2, bf16=bf16), total_steps=30)
    x = torch.randint(0, 256, (4, MODEL.context))
    y = torch.roll(x, -1, dims=1)
    losses = [trainer.step(x, y) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    assert trainer.steps_done == 30
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_factor(29, 30, trainer.cfg))
    # AdamW decays matrices only.
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]


def test_gradient_clipping_bounds_the_update() -> None:
    model = build_model(MODEL, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Plain SGD so the update is lr × clipped gradient, whose global norm is at most grad_clip.
    trainer = InnerTrainer(model, InnerConfig(lr=1.0, warmup_steps=0, grad_clip=1e-3), total_steps=1, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    x = torch.randint(0, 256, (4, MODEL.context))
    trainer.step(x, torch.roll(x, -1, dims=1))
    moved = math.sqrt(sum(float(((p.detach() - before[n]) ** 2).sum()) for n, p in model.named_parameters()))
    assert 0 < moved <= 1e-3 * 1.0001


def test_evaluate_bpb_is_loss_in_bits() -> None:
    model = build_model(MODEL, seed=0)
    x = torch.randint(0, 256, (2, MODEL.context))
    y = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        nats = float(lm_loss(model(x), y))
    assert evaluate_bpb(model, [(x, y)]) == pytest.approx(nats / math.log(2), rel=1e-6)
    # An untrained byte model is near the uniform 8 bits per byte.
    assert 7.0 < evaluate_bpb(model, [(x, y)]) < 9.0
    assert model.training  # evaluation restores the mode it found


@pytest.mark.parametrize(("field", "value"), [("lr", 0.0), ("min_lr_ratio", 2.0), ("warmup_steps", -1), ("grad_clip", -1.0)])
def test_inner_config_names_bad_fields(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"inner.{field}"):
        InnerConfig(**{field: value})


def test_flush_denormals_reaches_the_threads_started_after_it() -> None:
    # In a thread of its own (the setting is per thread): the pytest thread keeps subnormals.
    tiny = torch.tensor([1e-39])  # a subnormal float32
    seen: dict[str, object] = {}

    def process() -> None:
        seen["able"] = flush_denormals(True)
        seen["here"] = float(tiny * 1.0)
        child = threading.Thread(target=lambda: seen.__setitem__("child", float(tiny * 1.0)))
        child.start()
        child.join()

    thread = threading.Thread(target=process)
    thread.start()
    thread.join()
    if not seen["able"]:
        pytest.skip("this CPU cannot flush subnormal floats (no SSE3)")
    assert seen["here"] == 0.0 and seen["child"] == 0.0
    assert float(tiny * 1.0) == pytest.approx(1e-39, rel=1e-3)


def test_flush_denormal_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="inner.flush_denormal='yes'"):
        InnerConfig(flush_denormal="yes")  # type: ignore[arg-type]
