"""Error feedback: what a lossy encoding did not deliver is added to the next message, so a
link loses nothing over time. The sites use it on the uplink (Δ), the coordinator on the
downlink (the outer update). Imports only torch."""

from __future__ import annotations

from collections.abc import Mapping

import torch

Tensors = dict[str, torch.Tensor]


class ErrorFeedback:
    """The residual e of one link. ``compensate(x)`` is what to encode, x + β e; once the
    message counted, ``carry(intended, sent)`` keeps e = intended - sent for the next one.

    β = ``decay`` (1: plain error feedback; below 1 old error fades, as SparseLoCo's error
    buffer does). A message that did not count (a push the round closed without) must not
    move e on: the caller simply does not call ``carry``.
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay={decay}: must be in [0, 1]")
        self.decay = decay
        self.residual: Tensors | None = None

    def compensate(self, x: Mapping[str, torch.Tensor]) -> Tensors:
        """x + β e (x itself before the first residual)."""
        e = self.residual
        if e is None:
            return dict(x)
        if self.decay == 1.0:
            return {n: v + e[n] if n in e else v for n, v in x.items()}
        return {n: v + self.decay * e[n] if n in e else v for n, v in x.items()}

    @staticmethod
    def error(intended: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]) -> Tensors:
        """What the encoding lost: intended - sent, per tensor."""
        return {n: intended[n] - sent[n] for n in intended}

    def carry(self, residual: Tensors | None) -> None:
        """Keeps ``residual`` (``error(intended, sent)`` of a message that counted) for the next
        one. A residual of some tensors only (one fragment's) replaces theirs and keeps the
        others'; None forgets every residual."""
        if residual is None or self.residual is None:
            self.residual = residual
        else:
            self.residual = {**self.residual, **residual}
