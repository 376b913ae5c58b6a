"""Reference decoder-only transformer used by every DiLoCo worker.

Byte-level tokens in, next-byte logits out. The architecture is a small
Llama-style stack: pre-norm RMSNorm, rotary position embeddings, causal
self-attention through ``F.scaled_dot_product_attention`` and a SwiGLU MLP.

Every worker must start from bit-identical weights, so ``build_model`` derives
the whole initialisation from an explicit seed and never touches (or depends
on) the global RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODEL_SIZES",
    "ModelConfig",
    "Transformer",
    "build_model",
    "count_params",
    "lm_loss",
    "model_config",
]

# GPT-2 initialisation scale for every weight matrix and the embedding.
_INIT_STD = 0.02


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer. Immutable; validated on construction.

    ``context`` is the maximum sequence length T the model accepts (RoPE tables
    are precomputed for it). ``mlp_hidden`` is the SwiGLU hidden width, i.e.
    the width of each of the gate and up projections. Invalid values raise
    ``ValueError`` whose message starts with ``model.<field>=<value>:``.
    """

    name: str = "tiny"
    vocab_size: int = 256
    context: int = 128
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    mlp_hidden: int = 352
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_base: float = 10000.0

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
            raise ValueError(
                f"model.n_heads={self.n_heads}: must divide model.d_model={self.d_model}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"model.n_heads={self.n_heads}: head dim d_model/n_heads="
                f"{self.head_dim} must be even for rotary embeddings"
            )

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
}


def model_config(name: str, **overrides: object) -> ModelConfig:
    """Return the preset ``name`` from ``MODEL_SIZES`` with ``overrides`` applied.

    Raises ``ValueError`` for an unknown size, an unknown override field, or an
    override that fails ``ModelConfig`` validation.
    """
    if name not in MODEL_SIZES:
        known = ", ".join(MODEL_SIZES)
        raise ValueError(f"unknown model size {name!r} (model={name}); known: {known}")
    known_fields = {f.name for f in fields(ModelConfig)}
    for key in overrides:
        if key not in known_fields:
            raise ValueError(
                f"model.{key}: unknown field; known: {', '.join(sorted(known_fields))}"
            )
    return replace(MODEL_SIZES[name], **overrides)


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


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A CPU float32 ``Transformer`` whose weights depend only on ``(cfg, seed)``.

    The global RNG state is neither consumed nor consulted, so every worker
    calling this with the same arguments gets an identical ``state_dict()``.
    """
    # Module constructors run their own default init from the global RNG;
    # fork_rng restores it afterwards, and the explicit generator below then
    # overwrites every parameter.
    with torch.random.fork_rng(devices=[]):
        model = Transformer(cfg)
    model.reset_parameters(generator=torch.Generator().manual_seed(seed))
    return model


def count_params(model: nn.Module) -> int:
    """Number of scalar parameters, counting shared tensors once."""
    # parameters() already skips repeated registrations of one tensor; the
    # id() set also makes this safe for custom containers that do not.
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())
