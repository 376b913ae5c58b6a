"""Fragments that have stopped training (``sync.end=freeze``, docs/streaming.md).

At the end of a streaming run each fragment's last round is pushed H/F steps after the one
before it, so fragments 0 .. F−2 would train on past their last sync and need flush rounds,
which no training is left to hide. Frozen instead, a fragment keeps, from its last push on,
the values it was pushed from, and after its round lands, θ: the inner steps still run for
the other fragments (the same tokens), and this module puts the frozen fragment's values
back after each of them. Restoring after the step, rather than leaving the parameters out of
the optimizer, works unchanged for any trainer and layout (each rank restores what it holds).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from diloco.site.host_copy import HostMirror
from diloco.site.layouts.base import ParallelModel


class FrozenFragments:
    def __init__(self, layout: ParallelModel) -> None:
        self._layout = layout
        self._host = HostMirror()
        self._values: dict[str, torch.Tensor] = {}  # name -> the frozen value (host, this rank's part)

    def __bool__(self) -> bool:
        return bool(self._values)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._values)

    def _held(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        wanted = set(names)
        return {n: h.tensor for n, h in self._layout.held().items() if n in wanted}

    def freeze(self, names: Iterable[str]) -> None:
        """From now on the parameters ``names`` (those this rank holds) keep their values."""
        held = self._held(n for n in names if n not in self._values)
        self._values.update({n: t.detach().clone() for n, t in self._host.host(held).items()})

    def refresh(self) -> None:
        """The frozen values ← the model's: after a round landed (its merge, or θ whole on a
        catch-up, moved them)."""
        if self._values:
            self._values = {n: t.detach().clone() for n, t in self._host.host(self._held(self._values)).items()}

    def hold(self) -> None:
        """After an inner step: the frozen parameters back to their values."""
        if self._values:
            HostMirror.load(self._held(self._values), self._values)
