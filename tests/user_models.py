"""Model factories for model=custom, as a user would write them (tests and docs use them).

    diloco-sim model=custom model.factory=tests.user_models:mlp_lm 'model.kwargs={hidden:32}'

A factory is any function that returns a torch.nn.Module mapping token ids [B, T] to
next-token logits [B, T, vocab]. DiLoCo calls it with model.kwargs under a seeded RNG,
so it may initialise from torch's global RNG as usual. Importable from the repo root
(tests/ is a namespace package there).
"""

from __future__ import annotations

import torch
from torch import nn


class MLPLanguageModel(nn.Module):
    """Embedding -> MLP -> logits at each position, also mixing in the previous token.

    Causal by construction: position t sees only tokens t and t-1. Deliberately not the
    project's Transformer, so that tests exercise a model DiLoCo knows nothing about.
    """

    def __init__(self, vocab_size: int, context: int, hidden: int, output: str) -> None:
        super().__init__()
        self.context = context
        self.output = output
        self.emb = nn.Embedding(vocab_size, hidden)
        self.prev = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if idx.shape[1] > self.context:
            raise ValueError(f"sequence length {idx.shape[1]} > context={self.context}")
        x = self.emb(idx)
        shifted = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
        x = x + self.prev(shifted)
        logits = self.head(self.norm(x + self.mlp(x)))
        return {"logits": logits} if self.output == "dict" else logits


def mlp_lm(vocab_size: int = 256, context: int = 128, hidden: int = 64, output: str = "tensor") -> nn.Module:
    """A tiny next-token model; ``output="dict"`` returns ``{"logits": ...}`` instead of the tensor."""
    if output not in ("tensor", "dict"):
        raise ValueError(f"output={output!r}: must be 'tensor' or 'dict'")
    return MLPLanguageModel(vocab_size, context, hidden, output)


def not_a_module() -> int:
    """A broken factory: returns no model."""
    return 42


def bf16_lm() -> nn.Module:
    """A broken factory: DiLoCo keeps θ in float32."""
    return mlp_lm().to(torch.bfloat16)


def failing(reason: str = "no GPU here") -> nn.Module:
    """A factory whose call raises."""
    raise RuntimeError(reason)


NOT_CALLABLE = 3
