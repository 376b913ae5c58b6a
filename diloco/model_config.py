"""What model a run trains, as config: the built-in transformer's shape (``ModelConfig`` and
the ``MODEL_SIZES`` presets), a user factory (``CustomModelConfig``, ``model=custom``) or a
Hugging Face causal LM (``HFModelConfig``, ``model=hf``), each validated on construction
with errors that name the field. ``diloco.model`` builds them and re-exports these names."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, TypeAlias

from diloco.fields import setting


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the built-in transformer (Llama-style: pre-norm RMSNorm, rotary embeddings,
    SwiGLU). Immutable; invalid values raise ``ValueError`` whose message starts with
    ``model.<field>=<value>:``. Any field overrides the preset with +model.FIELD=VALUE."""

    name: str = setting(
        "tiny", doc="the size preset (MODEL_SIZES): tiny (about 0.64M parameters) | small (about 6.4M) | base (about 124M, GPT-2 small's sizes)"
    )
    vocab_size: int = setting(256, doc="the output width: token ids are below it (256: one token per byte)")
    context: int = setting(128, doc="the longest sequence T the model accepts (RoPE tables are precomputed for it); the data pipeline cuts sequences this long")
    d_model: int = setting(128, doc="the width of the residual stream")
    n_layers: int = setting(3, doc="transformer blocks")
    n_heads: int = setting(4, doc="attention heads; they divide d_model, and d_model/n_heads is even (rotary embeddings)")
    mlp_hidden: int = setting(352, doc="the SwiGLU hidden width: the width of each of the gate and up projections")
    tie_embeddings: bool = setting(True, doc="the output head reuses the token embedding's weights (false: a head of its own)")
    norm_eps: float = setting(1e-5, doc="RMSNorm's epsilon")
    rope_base: float = setting(10000.0, doc="the base of the rotary embeddings' frequencies")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model.name={self.name!r}: must be a non-empty string")
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default
            # bool is a subclass of int, so it has to be told apart explicitly.
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"model.{f.name}={value!r}: must be true or false")
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"model.{f.name}={value!r}: must be an integer")
                if value < 1:
                    raise ValueError(f"model.{f.name}={value}: must be >= 1")
            elif isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"model.{f.name}={value!r}: must be a number")
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"model.{f.name}={value}: must be a finite number > 0")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"model.n_heads={self.n_heads}: must divide model.d_model={self.d_model}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"model.n_heads={self.n_heads}: head dim d_model/n_heads={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (d_model // n_heads)."""
        return self.d_model // self.n_heads


MODEL_SIZES: dict[str, ModelConfig] = {
    # About 0.64M parameters: fast enough for CPU tests and smoke runs.
    "tiny": ModelConfig(),
    # About 6.4M parameters; mlp_hidden ~ 8/3 * d_model rounded to a multiple of 16.
    "small": ModelConfig(
        name="small",
        context=128,
        d_model=256,
        n_layers=8,
        n_heads=8,
        mlp_hidden=688,
    ),
    # About 124M parameters, GPT-2 small's sizes (vocab padded to a multiple of 64) for GPU
    # runs; with the SwiGLU MLP, mlp_hidden = 8/3 * d_model keeps GPT-2's MLP parameter count.
    "base": ModelConfig(
        name="base",
        vocab_size=50304,
        context=1024,
        d_model=768,
        n_layers=12,
        n_heads=12,
        mlp_hidden=2048,
    ),
}


def _plain(value: object, where: str) -> Any:
    """``value`` as JSON-able plain data (mappings become dicts, tuples lists).

    Every process rebuilds the run's config from JSON, so a factory's kwargs or a
    Hugging Face config must survive that trip and compare equal afterwards.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}={value!r}: must be a finite number")
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} must be a string")
            out[key] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"{where}={value!r}: must be plain data (null, bool, number, string, list or mapping)")


def _check_mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}={value!r}: must be a mapping")
    return _plain(value, where)


def _check_count(value: object, where: str) -> None:
    # bool is a subclass of int, so it has to be told apart explicitly.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}={value!r}: must be an integer")
    if value < 1:
        raise ValueError(f"{where}={value}: must be >= 1")


def _check_name(value: object, expected: str) -> None:
    if value != expected:
        raise ValueError(f"model.name={value!r}: must be {expected!r} for model={expected}")


def _check_spec(value: object, where: str) -> None:
    if value is not None and (not isinstance(value, str) or not value or (":" not in value and "." not in value)):
        raise ValueError(f"{where}={value!r}: must be a string 'package.module:function' (or null)")


def _json_hash(obj: object) -> int:
    # The mapping fields are dicts (unhashable); their canonical JSON is not.
    return hash(json.dumps(obj, sort_keys=True))


@dataclass(frozen=True)
class CustomModelConfig:
    """A model made by a user function (``model=custom``).

    ``build_model`` calls the factory with ``kwargs`` and nothing else, so a factory that
    needs ``vocab_size`` or ``context`` gets them through ``kwargs``. It must return an
    ``nn.Module`` with float32 CPU parameters that maps token ids ``[B, T]`` (``T <= context``)
    to logits ``[B, T, vocab_size]``, as a tensor, an object with ``.logits`` or a mapping
    with ``"logits"``.
    """

    name: str = setting("custom", doc="custom: a model made by the user function that `factory` names")
    # None only so that a missing factory gets a clear error.
    factory: str | None = setting(
        None,
        doc='required: "package.module:function" (an attribute path may follow the colon) or "package.module.function", imported from sys.path, then the working directory',
    )
    kwargs: Mapping[str, Any] = setting(
        doc="the factory's keyword arguments, and nothing else: a mapping of plain data (it travels to every process as JSON); null: none", factory=dict
    )
    context: int = setting(128, doc="the sequence length the data pipeline cuts; the model must accept it")
    vocab_size: int = setting(256, doc="the model's output width: token ids are below it (256: one token per byte)")
    parallelize: str | None = setting(
        None,
        doc='"package.module:function" called on every rank as function(model, device_mesh) to apply tensor parallelism (parallel.tp > 1) over the mesh\'s "tp" dimension; null: tp=1 only',
    )

    def __post_init__(self) -> None:
        _check_name(self.name, "custom")
        if self.factory is None or self.factory == "":
            raise ValueError("model.factory is required for model=custom (e.g. model.factory=package.module:function)")
        if not isinstance(self.factory, str):
            raise ValueError(f"model.factory={self.factory!r}: must be a string 'package.module:function'")
        # null (conf/model/custom.yaml's default, so that model.kwargs={...} can replace it
        # under hydra's struct mode) means no kwargs.
        kwargs = {} if self.kwargs is None else self.kwargs
        object.__setattr__(self, "kwargs", _check_mapping(kwargs, "model.kwargs"))
        _check_count(self.context, "model.context")
        _check_count(self.vocab_size, "model.vocab_size")
        _check_spec(self.parallelize, "model.parallelize")

    def __hash__(self) -> int:
        return _json_hash([self.name, self.factory, self.kwargs, self.context, self.vocab_size, self.parallelize])


# Where Hugging Face configs keep the longest sequence a model accepts.
HF_POSITION_KEYS = ("max_position_embeddings", "n_positions")


@dataclass(frozen=True)
class HFModelConfig:
    """A Hugging Face causal LM built from its config alone (``model=hf``; never downloaded;
    needs the extra: pip install -e '.[hf]')."""

    name: str = setting("hf", doc="hf: a Hugging Face causal LM built from `config` alone, never downloaded")
    config: Mapping[str, Any] = setting(
        doc="what transformers.AutoConfig.for_model takes: model_type and vocab_size required; max_position_embeddings (gpt2: n_positions) >= context",
        factory=dict,
    )
    context: int = setting(128, doc="the sequence length the data pipeline cuts")
    parallelize: str | None = setting(
        None,
        doc='"package.module:function" called on every rank as function(model, device_mesh) to apply tensor parallelism (parallel.tp > 1) over the mesh\'s "tp" dimension; Llama-style models: diloco.site.layouts.hf_llama:parallelize; null: tp=1 only',
    )

    def __post_init__(self) -> None:
        _check_name(self.name, "hf")
        config = _check_mapping(self.config, "model.config")
        object.__setattr__(self, "config", config)
        _check_count(self.context, "model.context")
        model_type = config.get("model_type")
        if model_type is None:
            raise ValueError("model.config.model_type is required for model=hf (e.g. llama, gpt2)")
        if not isinstance(model_type, str) or not model_type:
            raise ValueError(f"model.config.model_type={model_type!r}: must be a non-empty string")
        if "vocab_size" not in config:
            raise ValueError("model.config.vocab_size is required for model=hf (the data pipeline and the loss need the output width)")
        _check_count(config["vocab_size"], "model.config.vocab_size")
        for key in HF_POSITION_KEYS:
            if key in config:
                _check_count(config[key], f"model.config.{key}")
                check_context(config[key], self.context, f"model.config.{key}")
        _check_spec(self.parallelize, "model.parallelize")

    @property
    def vocab_size(self) -> int:
        """The model's output width, ``config["vocab_size"]``."""
        return int(self.config["vocab_size"])

    def __hash__(self) -> int:
        return _json_hash([self.name, self.config, self.context, self.parallelize])


def check_context(positions: int, context: int, where: str) -> None:
    if positions < context:
        raise ValueError(f"{where}={positions}: the model accepts at most {positions} positions but model.context={context}; raise it or lower model.context")


AnyModelConfig: TypeAlias = ModelConfig | CustomModelConfig | HFModelConfig

# model=<name> choices besides the MODEL_SIZES presets.
MODEL_KINDS: dict[str, type[CustomModelConfig] | type[HFModelConfig]] = {
    "custom": CustomModelConfig,
    "hf": HFModelConfig,
}


def is_builtin(cfg: AnyModelConfig) -> bool:
    """True for the built-in Transformer, whose structure (blocks, q/k/v, gate/up) the
    tensor- and pipeline-parallel layouts rely on."""
    return isinstance(cfg, ModelConfig)


def model_config(name: str, /, **overrides: object) -> AnyModelConfig:
    """The config of ``model=<name>``.

    ``tiny``, ``small`` and ``base`` are ``MODEL_SIZES`` presets with ``overrides``
    applied; ``custom`` and ``hf`` build a ``CustomModelConfig`` / ``HFModelConfig``
    from ``overrides``. Raises ``ValueError`` for an unknown name, an unknown
    field, or a value that fails validation.
    """
    if name in MODEL_SIZES:
        cls: type = ModelConfig
    elif name in MODEL_KINDS:
        cls = MODEL_KINDS[name]
    else:
        known = ", ".join([*MODEL_SIZES, *MODEL_KINDS])
        raise ValueError(f"unknown model {name!r} (model={name}); known: {known}")
    known_fields = {f.name for f in fields(cls)}
    for key in overrides:
        if key not in known_fields:
            raise ValueError(f"model.{key}: unknown field for model={name}; known: {', '.join(sorted(known_fields))}")
    if cls is ModelConfig:
        return replace(MODEL_SIZES[name], **overrides)
    return cls(**{"name": name, **overrides})
