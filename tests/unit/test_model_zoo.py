"""Models chosen by config: model=base, model=custom (a user factory), model=hf (transformers)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from diloco.app.config import run_config_from_dict, run_config_to_dict
from diloco.model import (
    MODEL_SIZES,
    CustomModelConfig,
    HFModelConfig,
    ModelConfig,
    Transformer,
    build_model,
    count_params,
    is_builtin,
    lm_loss,
    load_factory,
    model_config,
    model_logits,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
MLP = "tests.user_models:mlp_lm"
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


@pytest.fixture(autouse=True)
def _repo_root_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # `tests.user_models` is importable from the repo root, as it is for `python -m diloco...`.
    monkeypatch.syspath_prepend(str(ROOT))


def _transformers() -> None:
    pytest.importorskip("transformers", reason="model=hf needs the hf extra (pip install -e '.[hf]')")


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- model=base -----------------------------------------------------------------------------


def test_base_is_gpt2_small_sized_without_initialising_it() -> None:
    cfg = model_config("base")
    assert "base" in MODEL_SIZES and is_builtin(cfg)
    assert (cfg.vocab_size, cfg.context, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.mlp_hidden) == (50304, 1024, 768, 12, 12, 2048)
    assert cfg.tie_embeddings
    with torch.device("meta"):
        n = count_params(Transformer(cfg))
    d, h = cfg.d_model, cfg.mlp_hidden
    per_layer = 4 * d * d + 3 * d * h + 2 * d  # q, k, v, proj; gate, up, down; two RMSNorm gains
    assert n == cfg.vocab_size * d + cfg.n_layers * per_layer + d
    assert 120_000_000 <= n <= 128_000_000


# --- model=custom ---------------------------------------------------------------------------


def test_custom_factory_weights_come_from_the_seed_alone() -> None:
    cfg = model_config("custom", factory=MLP, kwargs={"hidden": 16})
    assert isinstance(cfg, CustomModelConfig) and not is_builtin(cfg)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    first = build_model(cfg, seed=3)
    torch.rand(100)  # wherever the global RNG is, the weights are the same
    second = build_model(cfg, seed=3)
    assert _same_weights(first, second)
    assert not _same_weights(first, build_model(cfg, seed=4))
    torch.manual_seed(5)
    build_model(cfg, seed=3)
    assert torch.equal(torch.rand(4), expected)  # and the caller's RNG is untouched
    # "pkg.mod.fn" names the same factory as "pkg.mod:fn".
    dotted = build_model(model_config("custom", factory="tests.user_models.mlp_lm", kwargs={"hidden": 16}), seed=3)
    assert _same_weights(first, dotted)


@pytest.mark.parametrize("output", ["tensor", "dict"])
def test_custom_model_trains_through_model_logits(output: str) -> None:
    cfg = model_config("custom", factory=MLP, kwargs={"hidden": 32, "context": 16, "output": output}, context=16)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, cfg.vocab_size, (4, cfg.context + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(10):
        logits = model_logits(model, x)
        assert logits.shape == (4, 16, cfg.vocab_size)
        loss = lm_loss(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_missing_factory_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="model.factory is required for model=custom"):
        model_config("custom")
    with pytest.raises(ValueError, match="model.factory is required for model=custom"):
        model_config("custom", factory=None, kwargs={"hidden": 8})


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("x", "model.factory='x': cannot import module 'x' (ModuleNotFoundError: No module named 'x')"),
        ("tests.nope:f", "cannot import module 'tests.nope' (ModuleNotFoundError"),
        ("tests.user_models:nope", "model.factory='tests.user_models:nope': module 'tests.user_models' has no attribute 'nope'"),
        ("tests.user_models:NOT_CALLABLE", "'NOT_CALLABLE' is not callable (it is int 3)"),
        ("tests.user_models:not_a_module", "model.factory='tests.user_models:not_a_module' returned int, which is not a torch.nn.Module"),
        ("tests.user_models:failing", "the call with model.kwargs={} raised RuntimeError: no GPU here"),
        ("tests.user_models:bf16_lm", "returned parameters of dtype torch.bfloat16; they must all be float32"),
        ("json", "model.factory='json': names a module, not a function; write 'json:function'"),
        ("tests.user_models:", "model.factory='tests.user_models:': must be 'package.module:function'"),
    ],
)
def test_bad_factories_say_what_is_wrong(factory: str, message: str) -> None:
    cfg = model_config("custom", factory=factory)  # the factory is only imported when built
    with pytest.raises(ValueError) as info:
        build_model(cfg, seed=0)
    assert message in str(info.value)


def test_a_factory_call_that_raises_names_its_kwargs() -> None:
    cfg = model_config("custom", factory=MLP, kwargs={"output": "tuple"})
    with pytest.raises(ValueError, match=r"model.kwargs=\{'output': 'tuple'\} raised ValueError: output='tuple'"):
        build_model(cfg, seed=0)


def test_factory_module_in_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A console script (diloco-sim) does not put the working directory on sys.path; the
    # factory's module is looked up there last.
    (tmp_path / "zoo_cwd_models.py").write_text("from torch import nn\n\ndef make(width=4):\n    return nn.Linear(width, width)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "zoo_cwd_models", raising=False)
    try:
        assert load_factory("zoo_cwd_models:make")(width=3).weight.shape == (3, 3)
        assert str(tmp_path) in sys.path
    finally:
        sys.modules.pop("zoo_cwd_models", None)


# --- model=hf ---------------------------------------------------------------------------------


def test_hf_builds_from_the_config_alone_and_forwards() -> None:
    _transformers()
    cfg = model_config("hf", config=TINY_LLAMA, context=64)
    assert isinstance(cfg, HFModelConfig) and cfg.vocab_size == 256 and not is_builtin(cfg)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    model = build_model(cfg, seed=1)
    assert torch.equal(torch.rand(4), expected)
    assert _same_weights(model, build_model(cfg, seed=1))
    assert not _same_weights(model, build_model(cfg, seed=2))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    logits = model_logits(model, x)  # a ModelOutput with .logits
    assert logits.shape == (2, 64, 256) and torch.isfinite(logits).all()
    assert 4.0 < lm_loss(logits, x).item() < 7.0  # near ln(256) = 5.55 nats at init


def test_hf_context_must_fit_the_model_positions() -> None:
    with pytest.raises(ValueError, match="model.config.max_position_embeddings=64: .* model.context=128"):
        model_config("hf", config=TINY_LLAMA, context=128)
    with pytest.raises(ValueError, match="model.config.n_positions=32"):
        model_config("hf", config={"model_type": "gpt2", "vocab_size": 256, "n_positions": 32}, context=64)
    _transformers()
    # A length the config leaves out is transformers' default (llama: 2048), checked at build.
    no_length = {k: v for k, v in TINY_LLAMA.items() if k != "max_position_embeddings"}
    with pytest.raises(ValueError, match="max_position_embeddings \\(transformers' default for llama\\)=2048"):
        build_model(model_config("hf", config=no_length, context=4096), seed=0)


def test_hf_unknown_model_type_is_named() -> None:
    _transformers()
    with pytest.raises(ValueError, match="model.config.model_type='no_such_model'"):
        build_model(model_config("hf", config={"model_type": "no_such_model", "vocab_size": 256}), seed=0)


def test_hf_without_transformers_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ValueError) as info:
        build_model(model_config("hf", config=TINY_LLAMA, context=64), seed=0)
    assert str(info.value) == "model=hf needs the Hugging Face extra: pip install -e '.[hf]' (transformers is not installed)"


# --- configs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("custom", {"factory": MLP, "context": 0}, "model.context=0: must be >= 1"),
        ("custom", {"factory": MLP, "vocab_size": "256"}, "model.vocab_size='256': must be an integer"),
        ("custom", {"factory": MLP, "vocab_size": True}, "model.vocab_size=True: must be an integer"),
        ("custom", {"factory": 3}, "model.factory=3: must be a string"),
        ("custom", {"factory": MLP, "kwargs": [1]}, "model.kwargs=[1]: must be a mapping"),
        ("custom", {"factory": MLP, "kwargs": {"dtype": torch.float16}}, "model.kwargs.dtype=torch.float16: must be plain data"),
        ("custom", {"factory": MLP, "kwargs": {1: 2}}, "model.kwargs: key 1 must be a string"),
        ("custom", {"factory": MLP, "hidden": 8}, "model.hidden: unknown field for model=custom"),
        ("custom", {"factory": MLP, "name": "mine"}, "model.name='mine': must be 'custom' for model=custom"),
        ("hf", {"config": TINY_LLAMA, "name": "custom"}, "model.name='custom': must be 'hf' for model=hf"),
        ("hf", {}, "model.config.model_type is required for model=hf"),
        ("hf", {"config": "llama"}, "model.config='llama': must be a mapping"),
        ("hf", {"config": {"model_type": "llama"}}, "model.config.vocab_size is required for model=hf"),
        ("hf", {"config": {"model_type": "llama", "vocab_size": 0}}, "model.config.vocab_size=0: must be >= 1"),
        ("hf", {"config": {"model_type": 7, "vocab_size": 256}}, "model.config.model_type=7: must be a non-empty string"),
        ("hf", {"config": TINY_LLAMA, "vocab_size": 256}, "model.vocab_size: unknown field for model=hf"),
        ("hf", {"config": TINY_LLAMA, "context": 2.5}, "model.context=2.5: must be an integer"),
        ("base", {"depth": 3}, "model.depth: unknown field for model=base"),
        ("huge", {}, "unknown model 'huge' (model=huge); known: tiny, small, base, custom, hf"),
    ],
)
def test_config_errors_name_the_field(name: str, fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        model_config(name, **fields)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "model",
    [
        {"name": "tiny"},
        {"name": "base"},
        {"name": "custom", "factory": MLP, "kwargs": {"hidden": 8, "sizes": (1, 2), "extra": {"a": None}}, "context": 64},
        {"name": "hf", "config": TINY_LLAMA, "context": 64},
    ],
    ids=lambda m: m["name"],
)
def test_every_kind_survives_the_trip_through_json(model: dict) -> None:
    cfg = run_config_from_dict({"mode": "single", "model": model})
    assert cfg.model.name == model["name"]
    assert run_config_from_dict(run_config_to_dict(cfg)) == cfg
    assert run_config_from_dict(json.loads(json.dumps(run_config_to_dict(cfg)))) == cfg
    assert hash(cfg.model) == hash(run_config_from_dict(run_config_to_dict(cfg)).model)


def test_hydra_composes_each_kind() -> None:
    from hydra import compose, initialize_config_module

    from diloco.cli.common import SECTIONS, run_config

    with initialize_config_module("diloco.conf", version_base=None):
        custom = run_config(
            compose("sim", overrides=["model=custom", f"model.factory={MLP}", "model.kwargs={hidden:16,context:64}", "model.context=64"]), SECTIONS["sim"]
        )
        bare = run_config(compose("sim", overrides=["model=custom", f"model.factory={MLP}"]), SECTIONS["sim"])
        hf = run_config(compose("sim", overrides=["model=hf"]), SECTIONS["sim"])
        hf_wider = run_config(compose("sim", overrides=["model=hf", "model.config.hidden_size=128"]), SECTIONS["sim"])
        base = run_config(compose("sim", overrides=["model=base"]), SECTIONS["sim"])
    assert custom.model == CustomModelConfig(factory=MLP, kwargs={"hidden": 16, "context": 64}, context=64)
    assert bare.model == CustomModelConfig(factory=MLP)
    assert isinstance(hf.model, HFModelConfig) and hf.model.config["model_type"] == "llama"
    assert (hf.model.vocab_size, hf.model.context, hf.model.config["max_position_embeddings"]) == (256, 128, 128)
    assert hf_wider.model.config["hidden_size"] == 128 and hf_wider.model.config["num_hidden_layers"] == hf.model.config["num_hidden_layers"]
    assert base.model == MODEL_SIZES["base"] and isinstance(base.model, ModelConfig)
    assert isinstance(build_model(custom.model, seed=0), nn.Module)
    _transformers()
    # conf/model/hf.yaml alone gives a model that builds and runs on a CPU in seconds.
    model = build_model(hf.model, seed=0)
    assert count_params(model) < 1_000_000
    assert model_logits(model, torch.zeros(1, hf.model.context, dtype=torch.long)).shape == (1, 128, 256)


# --- model_logits -----------------------------------------------------------------------------


class _Returns(nn.Module):
    def __init__(self, make: object) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> object:
        return self.make(torch.zeros(*x.shape, 5))  # type: ignore[operator]


def test_model_logits_unwraps_tensors_outputs_and_mappings() -> None:
    x = torch.zeros(2, 3, dtype=torch.long)
    for make in (lambda t: t, lambda t: SimpleNamespace(logits=t, loss=None), lambda t: {"logits": t, "aux": 1}):
        assert model_logits(_Returns(make), x).shape == (2, 3, 5)
    with pytest.raises(TypeError, match=r"_Returns returned tuple of 2; expected logits \[B, T, vocab\]"):
        model_logits(_Returns(lambda t: (t, t)), x)
    with pytest.raises(TypeError, match=r"returned dict with keys \['hidden'\]"):
        model_logits(_Returns(lambda t: {"hidden": t}), x)
    with pytest.raises(ValueError, match=r"logits of shape \(2, 3\) for input \(2, 3\)"):
        model_logits(_Returns(lambda t: t[..., 0]), x)
    assert isinstance({"logits": 1}, Mapping)
