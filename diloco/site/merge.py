"""How a landed round meets the model's local values (``sync.merge``), for a site that kept
training while the round was in flight (streaming's τ steps) or not at all (τ = 0).

* ``mix``: local ← w·local + (1 − w)·θ with w = ``sync.local_weight`` (0: θ replaces the local
  values, plain DiLoCo; 0.5: Streaming DiLoCo's mix);
* ``delta``: local ← θ + (local − local at the push): the steps trained since the push, on top
  of θ, none lost and none counted twice;
* ``ahead``: delta, with those steps taken from a look-ahead of the outer step in flight: at
  the push the fragment moves by the coordinator's momentum (and ``sync.lookahead_weight`` ×
  the site's own Δ), so the overlapped steps start nearer where the merge puts them.

The site's θ stays exact in every case: only the model's values are merged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.outer import pseudo_gradient
from diloco.outer.eager import EagerStart
from diloco.site.local_model import LocalModel
from diloco.sync import Merge

Tensors = Mapping[str, torch.Tensor]


class Mix:
    def __init__(self, local_weight: float) -> None:
        self.local_weight = float(local_weight)

    def at_push(self, model: LocalModel, round: int, names: tuple[str, ...], reference: Tensors) -> dict[str, torch.Tensor] | None:
        """What the merge needs of the model when round ``round`` is pushed (nothing here)."""
        return None

    def land(self, model: LocalModel, theta: Tensors, names: tuple[str, ...] | None, at_push: Tensors | None) -> None:
        """The model's parameters (``names``: only those) ← the merge of θ and their values."""
        held = model.tensors(names)
        values = {n: theta[n] for n in held}
        if self.local_weight > 0:
            local = model.values(held)
            values = {n: torch.lerp(values[n], local[n].float(), self.local_weight) for n in held}
        model.load(values, held)


class Delta:
    def at_push(self, model: LocalModel, round: int, names: tuple[str, ...], reference: Tensors) -> dict[str, torch.Tensor] | None:
        """The fragment's local values when pushed: the steps trained after it are re-applied."""
        return model.copy(names)

    def land(self, model: LocalModel, theta: Tensors, names: tuple[str, ...] | None, at_push: Tensors | None) -> None:
        assert at_push is not None, "merge=delta needs the values at the push"
        held = model.tensors(names)
        local = model.values(held)
        model.load({n: theta[n] + (local[n].float() - at_push[n]) for n in held}, held)


class Ahead(Delta):
    def __init__(self, lookahead: EagerStart) -> None:
        self.lookahead = lookahead

    def at_push(self, model: LocalModel, round: int, names: tuple[str, ...], reference: Tensors) -> dict[str, torch.Tensor] | None:
        """The fragment moved by the look-ahead of round ``round``'s outer step (every rank
        holding a slice computes the same offset from the same values, so replicas agree), and
        its values as the model then holds them (a bf16 model rounds)."""
        local = model.copy(names)
        own = pseudo_gradient({n: reference[n] for n in local}, local)
        for n, o in self.lookahead.offset(round, own).items():
            local[n].add_(o)
        model.load(local, local)
        return model.copy(local)


def merge_for(merge: Merge, local_weight: float, lookahead: EagerStart | None) -> Mix | Delta:
    if merge == Merge.MIX:
        return Mix(local_weight)
    if merge == Merge.DELTA:
        return Delta()
    assert lookahead is not None, "merge=ahead follows the outer step: it needs the look-ahead"
    return Ahead(lookahead)
