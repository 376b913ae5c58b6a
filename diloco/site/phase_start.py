"""Where a site's inner phase starts, and what its Δ is measured from (``sync.mode``).

* ``blocking``: from θ after the round; the site waits for every round, so Δ = θ − local.
* ``delayed``: the site pushes and trains on at once; the next phase starts from θ as known
  when pushing (one round old), and Δ is measured from that start.
* ``eager``: the same, the start moved by the outer step's look-ahead with the site's own Δ
  standing in for (a share of) the mean still in flight (diloco.outer.eager).

Under delayed and eager the model is always mid-phase from its own start point, so a landed
round updates θ but not the model (``overlaps_phase``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.outer.eager import EagerStart
from diloco.site.local_model import LocalModel
from diloco.sync import SyncMode


class FromGlobal:
    """blocking: every phase starts from θ."""

    overlaps_phase = False
    keeps_own_delta = False

    def reference(self, theta: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return theta

    def after_load(self, model: LocalModel) -> None:
        """The model was loaded with θ whole (a join or a catch-up)."""

    def restart(self, theta: Mapping[str, torch.Tensor], round: int, own: Mapping[str, torch.Tensor] | None, model: LocalModel) -> None:
        raise AssertionError("a blocking site waits for its round: no phase restarts before it lands")


class Delayed:
    """delayed: the next phase starts from θ as known when pushing."""

    overlaps_phase = True
    keeps_own_delta = False

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] | None = None  # the phase's start point (host, float32)

    def reference(self, theta: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return theta if self.start is None else self.start

    def after_load(self, model: LocalModel) -> None:
        self.start = model.copy()

    def restart(self, theta: Mapping[str, torch.Tensor], round: int, own: Mapping[str, torch.Tensor] | None, model: LocalModel) -> None:
        """Right after pushing round ``round`` (``own``: its Δ; None after a diverged round): the
        next phase starts here."""
        start = {n: t.clone() for n, t in theta.items()}
        self._move(start, round, own)
        model.load(start)
        self.start = start

    def _move(self, start: dict[str, torch.Tensor], round: int, own: Mapping[str, torch.Tensor] | None) -> None:
        pass


class Eager(Delayed):
    """eager: the next phase starts from θ moved by the look-ahead of the outer step in flight."""

    keeps_own_delta = True

    def __init__(self, lookahead: EagerStart) -> None:
        super().__init__()
        self.lookahead = lookahead

    def _move(self, start: dict[str, torch.Tensor], round: int, own: Mapping[str, torch.Tensor] | None) -> None:
        if own is not None:
            for n, o in self.lookahead.offset(round, own).items():
                start[n].add_(o)


def phase_start(mode: SyncMode, lookahead: EagerStart | None) -> FromGlobal | Delayed:
    if mode == SyncMode.BLOCKING:
        return FromGlobal()
    if mode == SyncMode.DELAYED:
        return Delayed()
    assert lookahead is not None, "mode=eager follows the outer step: it needs the look-ahead"
    return Eager(lookahead)
