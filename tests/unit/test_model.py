"""Tests for diloco.model: sizes, shapes, causality, deterministic init, training."""

from __future__ import annotations

import pytest
import torch

from diloco.model import (
    MODEL_SIZES,
    ModelConfig,
    Transformer,
    build_model,
    count_params,
    lm_loss,
    model_config,
)

pytestmark = pytest.mark.timeout(60)


def test_tiny_param_count_under_one_million() -> None:
    n = count_params(build_model(model_config("tiny"), seed=0))
    assert 500_000 <= n < 1_000_000


def test_small_param_count_between_five_and_ten_million() -> None:
    n = count_params(build_model(model_config("small"), seed=0))
    assert 5_000_000 <= n <= 10_000_000


def test_known_sizes() -> None:
    assert set(MODEL_SIZES) == {"tiny", "small", "base"}
    assert model_config("small").name == "small"


def test_forward_shape_and_dtype() -> None:
    cfg = model_config("tiny")
    model = build_model(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_full_context_accepted_longer_rejected() -> None:
    cfg = model_config("tiny", context=32)
    model = build_model(cfg, seed=0)
    assert model(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 32, cfg.vocab_size)
    with pytest.raises(ValueError, match="context=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    cfg = model_config("tiny")
    model = build_model(cfg, seed=1).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 25] = (changed[:, 25] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :25], b[:, :25], rtol=0, atol=1e-6)
    # The changed position itself (and later ones) must see the change.
    assert not torch.allclose(a[:, 25:], b[:, 25:])


def test_same_seed_gives_identical_state_dict_regardless_of_global_rng() -> None:
    cfg = model_config("tiny")
    torch.manual_seed(123)
    first = build_model(cfg, seed=7).state_dict()
    torch.rand(1000)  # advance the global RNG
    torch.manual_seed(999)
    second = build_model(cfg, seed=7).state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_different_seed_gives_different_weights() -> None:
    cfg = model_config("tiny")
    a = build_model(cfg, seed=0).state_dict()
    b = build_model(cfg, seed=1).state_dict()
    assert not torch.equal(a["tok_emb.weight"], b["tok_emb.weight"])


def test_build_model_leaves_global_rng_untouched() -> None:
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    build_model(model_config("tiny"), seed=3)
    assert torch.equal(torch.rand(4), expected)


def test_parameters_are_float32_in_deterministic_order() -> None:
    model = build_model(model_config("tiny"), seed=0)
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in build_model(model_config("tiny"), seed=1).named_parameters()]
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # RMSNorm gains are parameters too, initialised to one.
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    # RoPE tables are non-persistent buffers, not state.
    assert not any("rope" in key for key in model.state_dict())


def test_untied_head_adds_exactly_one_vocab_by_dmodel_matrix() -> None:
    tied = model_config("tiny", tie_embeddings=True)
    untied = model_config("tiny", tie_embeddings=False)
    n_tied = count_params(build_model(tied, seed=0))
    n_untied = count_params(build_model(untied, seed=0))
    assert n_untied - n_tied == tied.vocab_size * tied.d_model
    assert build_model(untied, seed=0)(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)


def test_count_params_counts_shared_tensor_once() -> None:
    shared = torch.nn.Linear(4, 4, bias=False)
    container = torch.nn.Sequential(shared, shared)
    assert count_params(container) == 16


def test_adamw_steps_on_repeated_batch_lower_loss() -> None:
    cfg = model_config("tiny", context=32)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, cfg.vocab_size, (4, cfg.context + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(15):
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Initial loss is close to uniform over bytes: ln(256) ~ 5.55 nats.
    assert abs(losses[0] - 5.545) < 0.1
    assert losses[-1] < losses[0] - 0.5


def test_lm_loss_is_float32_under_autocast() -> None:
    model = build_model(model_config("tiny", context=16), seed=0)
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(idx)
        loss = lm_loss(logits, idx)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    assert loss.dim() == 0


def test_transformer_constructor_works_directly() -> None:
    model = Transformer(ModelConfig(context=8))
    assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 256)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n_heads": 0}, "model.n_heads=0"),
        ({"d_model": 0}, "model.d_model=0"),
        ({"context": -1}, "model.context=-1"),
        ({"vocab_size": 0}, "model.vocab_size=0"),
        ({"mlp_hidden": 0}, "model.mlp_hidden=0"),
        ({"n_heads": 3}, "model.n_heads=3"),  # 128 % 3 != 0
        ({"d_model": 96, "n_heads": 32}, "model.n_heads=32"),  # head dim 3 is odd
        ({"norm_eps": 0.0}, "model.norm_eps=0.0"),
    ],
)
def test_config_errors_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig(**overrides)  # type: ignore[arg-type]
    assert field in str(info.value)


def test_unknown_model_size_names_size_and_known_sizes() -> None:
    with pytest.raises(ValueError) as info:
        model_config("huge")
    message = str(info.value)
    assert "'huge'" in message
    assert "tiny" in message and "small" in message


def test_model_config_overrides_are_validated() -> None:
    assert model_config("tiny", context=64).context == 64
    with pytest.raises(ValueError, match="model.n_layers=0"):
        model_config("tiny", n_layers=0)
    with pytest.raises(ValueError, match="model.depth"):
        model_config("tiny", depth=4)
