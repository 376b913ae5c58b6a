"""Reference decoder-only transformer used by every DiLoCo worker.

Byte-level tokens in, next-byte logits out. The architecture is a small
Llama-style stack: pre-norm RMSNorm, rotary position embeddings, causal
self-attention through ``F.scaled_dot_product_attention`` and a SwiGLU MLP.

Every worker must start from bit-identical weights, so ``build_model`` derives
the whole initialisation from an explicit seed and never touches (or depends
on) the global RNG.

Other models are chosen by config too (``model_config``, diloco/model_config.py, whose
names this module re-exports): ``model=custom`` calls
a user factory (``CustomModelConfig``), ``model=hf`` builds a Hugging Face causal
LM from its config alone (``HFModelConfig``). Code that trains or evaluates any of
them calls ``model_logits`` rather than ``model(x)``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from diloco.model_config import (
    HF_POSITION_KEYS,
    MODEL_KINDS,
    MODEL_SIZES,
    AnyModelConfig,
    CustomModelConfig,
    HFModelConfig,
    ModelConfig,
    check_context,
    is_builtin,
    model_config,
)

__all__ = [
    "MODEL_KINDS",
    "MODEL_SIZES",
    "AnyModelConfig",
    "CustomModelConfig",
    "HFModelConfig",
    "ModelConfig",
    "Transformer",
    "build_model",
    "count_params",
    "is_builtin",
    "lm_loss",
    "load_factory",
    "load_parallelize",
    "model_config",
    "model_logits",
]

# GPT-2 initialisation scale for every weight matrix and the embedding.
_INIT_STD = 0.02


def _rms_norm(dim: int, eps: float) -> nn.Module:
    if hasattr(nn, "RMSNorm"):
        return nn.RMSNorm(dim, eps=eps)
    return _FallbackRMSNorm(dim, eps)


class _FallbackRMSNorm(nn.Module):
    """RMSNorm for torch versions that predate ``nn.RMSNorm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


def _rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, float32 [context, head_dim // 2]."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(cfg.context, dtype=torch.float64), inv_freq)
    # Computed in float64 so long contexts keep accurate angles; stored as float32.
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by position; cos/sin are [T, D/2]."""
    # Rotate in float32 so bf16 autocast does not lose positional precision.
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        # Separate q, k and v projections (not one fused matrix), so that tensor parallelism
        # can give each rank whole heads by splitting every one of them by rows.
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds only some of the heads.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Separate gate and up projections, so that tensor parallelism can split both by rows.
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = _rms_norm(cfg.d_model, cfg.norm_eps)
        self.attn = _Attention(cfg)
        self.mlp_norm = _rms_norm(cfg.d_model, cfg.norm_eps)
        self.mlp = _SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


# Parameters that write into the residual stream; GPT-2 shrinks their init by
# 1/sqrt(2 * n_layers) so the residual variance does not grow with depth.
_RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.down.weight")


class Transformer(nn.Module):
    """Decoder-only byte-level language model.

    ``forward(idx)`` takes integer token ids ``[B, T]`` with ``1 <= T <=
    cfg.context`` and returns next-token logits ``[B, T, cfg.vocab_size]``
    (float32, or the autocast dtype under autocast). Position ``t`` only sees
    tokens ``0..t``. All parameters are float32; the RoPE tables are
    non-persistent buffers, so they are not in ``state_dict()``.

    Constructing it directly initialises from the global RNG; use
    ``build_model`` for seed-determined weights.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _rms_norm(cfg.d_model, cfg.norm_eps)
        # With tied embeddings the head reuses tok_emb.weight in forward, so
        # there is no second (aliased) parameter to deduplicate anywhere.
        self.head: nn.Linear | None = None
        if not cfg.tie_embeddings:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-initialise every parameter (GPT-2 style) from ``generator``.

        ``generator`` must live on the parameters' device; ``None`` uses the
        global RNG.
        """
        residual_std = _INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:  # norm gains; the model has no biases
                param.fill_(1.0)
            elif name.endswith(_RESIDUAL_PROJECTIONS):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, _INIT_STD, generator=generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T], got shape {tuple(idx.shape)}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        t = idx.shape[1]
        if not 1 <= t <= self.cfg.context:
            raise ValueError(f"sequence length {t} must be in [1, context={self.cfg.context}]")
        x = self.tok_emb(idx)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.norm(x)
        if self.head is None:
            return F.linear(x, self.tok_emb.weight)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in nats per token, as a float32 scalar.

    ``logits`` is ``[..., vocab]`` and ``targets`` the matching integer ids
    ``[...]``. Computed in float32 even inside an autocast region.
    """
    with torch.autocast(device_type=logits.device.type, enabled=False):
        flat = logits.float().reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, targets.reshape(-1).long())


@overload
def build_model(cfg: ModelConfig, seed: int) -> Transformer: ...
@overload
def build_model(cfg: CustomModelConfig | HFModelConfig, seed: int) -> nn.Module: ...


def build_model(cfg: AnyModelConfig, seed: int) -> nn.Module:
    """A CPU float32 model whose weights depend only on ``(cfg, seed)``.

    The global RNG state is neither consumed nor consulted, so every worker
    calling this with the same arguments gets an identical ``state_dict()``.
    Raises ``ValueError`` naming the field when a custom factory or a Hugging
    Face config cannot give such a model.
    """
    if isinstance(cfg, ModelConfig):
        # Module constructors run their own default init from the global RNG;
        # fork_rng restores it afterwards, and the explicit generator below then
        # overwrites every parameter.
        with torch.random.fork_rng(devices=[]):
            model = Transformer(cfg)
        model.reset_parameters(generator=torch.Generator().manual_seed(seed))
        return model
    if isinstance(cfg, CustomModelConfig):
        return _build_custom(cfg, seed)
    if isinstance(cfg, HFModelConfig):
        return _build_hf(cfg, seed)
    raise TypeError(f"build_model needs a model config, got {type(cfg).__name__}")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run a third-party constructor, which initialises from the global RNG, from ``seed``.

    Only the CPU generator is seeded (``torch.manual_seed`` would also reseed CUDA's,
    which fork_rng(devices=[]) does not restore), and it is restored on exit.
    """
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield


def _import_module(module: str, where: str) -> Any:
    try:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            # A console script (diloco-sim) does not put the working directory on sys.path
            # the way `python -m` does; look there last, so that a factory module beside
            # the run's config works either way.
            cwd = os.getcwd()
            ours = e.name is not None and e.name.split(".")[0] == module.split(".")[0]
            if not ours or cwd in sys.path or "" in sys.path:
                raise
            sys.path.append(cwd)
            return importlib.import_module(module)
    except Exception as e:  # not found, or the module's own code raised while importing
        raise ValueError(f"{where}: cannot import module {module!r} ({type(e).__name__}: {e})") from e


def load_factory(spec: str, key: str = "model.factory") -> Callable[..., Any]:
    """The callable that ``model.factory`` (or ``key``) names: ``"pkg.mod:fn"`` (an attribute
    path may follow the colon) or ``"pkg.mod.fn"``. Imports from sys.path, then the working
    directory."""
    where = f"{key}={spec!r}"
    if ":" in spec:
        module, _, attrs = spec.partition(":")
        if not module or not attrs:
            raise ValueError(f"{where}: must be 'package.module:function'")
    elif "." in spec:
        module, _, attrs = spec.rpartition(".")
    else:
        module, attrs = spec, ""
    obj = _import_module(module, where)
    if not attrs:
        raise ValueError(f"{where}: names a module, not a function; write '{module}:function'")
    for attr in attrs.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(f"{where}: {type(obj).__name__} {getattr(obj, '__name__', module)!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{where}: {attrs!r} is not callable (it is {type(obj).__name__} {obj!r:.60})")
    return obj


def _check_built(model: object, what: str) -> nn.Module:
    """DiLoCo keeps θ as float32 CPU parameters; refuse anything else by name."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{what} returned {type(model).__name__}, which is not a torch.nn.Module")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{what} returned a {type(model).__name__} with no parameters")
    dtypes = {p.dtype for p in params if p.dtype != torch.float32}
    if dtypes:
        got = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(f"{what} returned parameters of dtype {got}; they must all be float32")
    devices = {str(p.device) for p in params if p.device.type != "cpu"}
    if devices:
        got = ", ".join(sorted(devices))
        raise ValueError(f"{what} returned parameters on {got}; build them on the CPU (layouts move them)")
    return model


def _build_custom(cfg: CustomModelConfig, seed: int) -> nn.Module:
    assert cfg.factory is not None  # __post_init__ refuses None
    factory = load_factory(cfg.factory)
    what = f"model.factory={cfg.factory!r}"
    try:
        with _seeded(seed):
            model = factory(**cfg.kwargs)
    except Exception as e:
        raise ValueError(f"{what}: the call with model.kwargs={cfg.kwargs!r} raised {type(e).__name__}: {e}") from e
    return _check_built(model, what)


_HF_MISSING = "model=hf needs the Hugging Face extra: pip install -e '.[hf]' (transformers is not installed)"


def _build_hf(cfg: HFModelConfig, seed: int) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ValueError(_HF_MISSING) from None
    model_type = cfg.config["model_type"]
    where = f"model.config.model_type={model_type!r}"
    try:
        # Training never reuses attention caches; keeping them would only cost memory.
        hf_config = transformers.AutoConfig.for_model(**{"use_cache": False, **cfg.config})
    except Exception as e:
        mapping = getattr(transformers, "CONFIG_MAPPING", None)
        if mapping is not None and model_type not in mapping:
            raise ValueError(f"{where}: transformers {transformers.__version__} does not know this model type") from e
        raise ValueError(f"model.config: transformers cannot make a {model_type} config from it ({type(e).__name__}: {e})") from e
    for key in HF_POSITION_KEYS:
        positions = getattr(hf_config, key, None)
        if isinstance(positions, int):
            # Also catches a default the config left out (llama: 2048, gpt2: 1024).
            given = "" if key in cfg.config else f" (transformers' default for {model_type})"
            check_context(positions, cfg.context, f"model.config.{key}{given}")
            break
    try:
        with _seeded(seed):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as e:
        raise ValueError(f"{where}: transformers cannot build a causal LM from model.config ({type(e).__name__}: {e})") from e
    return _check_built(model, f"model=hf ({type(model).__name__})")


def load_parallelize(cfg: AnyModelConfig) -> Callable[[nn.Module, Any], Any] | None:
    """The function that ``model.parallelize`` names (model=custom, model=hf), or None."""
    spec = getattr(cfg, "parallelize", None)
    return None if spec is None else load_factory(spec, "model.parallelize")


def model_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)``'s next-token logits ``[B, T, vocab]``, whatever the model wraps them in.

    The built-in Transformer and most custom models return the tensor; Hugging Face
    models a ModelOutput with ``.logits``; some models a mapping with ``"logits"``.
    """
    out = model(x)
    if isinstance(out, torch.Tensor):
        logits = out
    elif isinstance(getattr(out, "logits", None), torch.Tensor):
        logits = out.logits
    elif isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        logits = out["logits"]
    else:
        got = type(out).__name__
        if isinstance(out, Mapping):
            got += f" with keys {sorted(map(str, out))}"
        elif isinstance(out, (tuple, list)):
            got += f" of {len(out)}"
        raise TypeError(
            f"{type(model).__name__} returned {got}; expected logits [B, T, vocab]: a tensor, "
            f"an object with .logits (a Hugging Face ModelOutput) or a mapping with 'logits'"
        )
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(
            f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for input "
            f"{tuple(x.shape)}; expected [B, T, vocab] = [{x.shape[0]}, {x.shape[1]}, vocab]"
        )
    return logits


def count_params(model: nn.Module) -> int:
    """Number of scalar parameters, counting shared tensors once."""
    # parameters() already skips repeated registrations of one tensor; the
    # id() set also makes this safe for custom containers that do not.
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())
