"""Token-weighted mean of the sites' pseudo-gradients, accumulated in one buffer."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

# The coordinator's average of a round's pseudo-gradients (the run's ``aggregate``): the
# token-weighted mean over the sites (``mean``) or, per coordinate, over the sites whose Δ is
# nonzero there (``nonzero``: the sparse codecs'), both streamed into one buffer
# (WeightedMean); or a coordinate-wise robust statistic over the round's pushes, unweighted,
# which keeps every push (``trimmed_mean``, ``median``: diloco.outer.robust.StackedAggregate).
WEIGHTED = ("mean", "nonzero")
AGGREGATES = (*WEIGHTED, "trimmed_mean", "median")


def check_aggregate(name: object) -> None:
    """The one check of an ``aggregate`` setting."""
    if name not in AGGREGATES:
        raise ValueError(f"aggregate={name!r}: must be one of {', '.join(AGGREGATES)}")


class WeightedMean:
    """Accumulates Σ w_s·Δ_s and Σ w_s; memory is one float64 copy of the parameters,
    however many sites contribute. Weights are the tokens each site processed.

    ``aggregate="nonzero"`` divides each coordinate by the weight of only the sites whose Δ
    is nonzero there (a coordinate no site sent stays 0), at the cost of a second float64
    copy. For sparse codecs: a value that one site of four kept is otherwise divided by all
    four, although the others did not send a zero but a "not yet" (their error feedback
    still holds their share of it), so the step shrinks fourfold wherever the sites chose
    different coordinates (docs/results.md). For dense codecs it equals the mean except
    where a Δ is exactly 0.

    Why float64: pushes arrive in any order and float32 addition is not associative, so a
    float32 sum would make the same run give different θ from one run to the next. In
    float64, w·Δ is exact (a 24-bit mantissa times an integer weight below 2^29) and the
    order only moves the sum by ~1e-16 relative, which the final rounding of the mean to
    float32 removes except in vanishingly rare ties (tests/test_outer_math.py checks this).
    Sums of weights are exact in any order.
    """

    def __init__(self, shapes: Mapping[str, torch.Size], aggregate: str = "mean", reuse: WeightedMean | None = None) -> None:
        """``reuse``: the previous round's accumulator, done with (its mean taken): its float64
        sums are taken over and zeroed in place when they fit, rather than allocated anew (a
        fresh allocation of that size costs the kernel's page faults and zeroing every round)."""
        if aggregate not in WEIGHTED:
            raise ValueError(f"aggregate={aggregate!r}: a weighted mean is one of {', '.join(WEIGHTED)}")
        self._shapes = dict(shapes)
        self._nonzero = aggregate == "nonzero"
        # Allocated (zeroed) by the first add, not when the round opens: a commit opens the
        # next round while the closing push's site waits for its answer.
        self._sum: dict[str, torch.Tensor] = {}
        self._weight: dict[str, torch.Tensor] | None = None
        self.total_weight = 0.0
        self.count = 0
        self._spare: dict[str, torch.Tensor] = {}
        if reuse is not None:
            self._spare, reuse._sum = reuse._sum, {}

    def _allocate(self) -> None:
        spare = self._spare if {n: t.shape for n, t in self._spare.items()} == self._shapes else {}
        self._spare = {}
        self._sum = {n: spare[n].zero_() if spare else torch.zeros(s, dtype=torch.float64) for n, s in self._shapes.items()}
        self._weight = {n: torch.zeros(s, dtype=torch.float64) for n, s in self._shapes.items()} if self._nonzero else None

    def add(self, delta: Mapping[str, torch.Tensor], weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if len(self._sum) != len(self._shapes):
            self._allocate()
        for name, buf in self._sum.items():
            # Added in float64 without a float64 copy of Δ first: the same values (Δ is cast
            # to float64 as it is read; tests/unit check it bit for bit).
            buf.add_(delta[name], alpha=weight)
            if self._weight is not None:
                self._weight[name].add_(delta[name] != 0, alpha=weight)
        self.total_weight += weight
        self.count += 1

    def add_with(self, accumulate: Callable[[Mapping[str, torch.Tensor], float], None], weight: float) -> None:
        """``add`` for a Δ that adds itself: ``accumulate(sums, weight)`` adds weight × Δ into the
        float64 sums (the coordinator's fused intake, diloco.wire.held: no float32 copy of Δ).
        Only for ``mean``: ``nonzero`` counts where each Δ is nonzero, which needs its values."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if self._nonzero:
            raise ValueError("aggregate=nonzero counts where each Δ is nonzero: add its values")
        if len(self._sum) != len(self._shapes):
            self._allocate()
        accumulate(self._sum, weight)
        self.total_weight += weight
        self.count += 1

    def add_zero(self, weight: float) -> None:
        """A Δ of zeros with this weight (a withheld site under quorum.withheld=zero): only the
        total weight grows, so the mean shrinks by the share of the weight that sent nothing.
        Under ``nonzero`` it changes nothing (a zero is no value there)."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        self.total_weight += weight

    def sums(self) -> tuple[dict[str, torch.Tensor], float] | None:
        """The float64 sums Σ w_s·Δ_s (by reference, name -> tensor) and the total weight that
        ``mean`` divides them by, for a caller that takes the mean block by block
        (``torch.div(sum, total_weight)`` rounded to float32, as ``mean`` does): only for
        ``mean`` with a contribution; None otherwise."""
        if self._weight is not None or self.count == 0 or len(self._sum) != len(self._shapes):
            return None
        return self._sum, self.total_weight

    def mean(self) -> dict[str, torch.Tensor]:
        if self.count == 0:
            raise ValueError("no contributions to average")
        if self._weight is None:
            # Divided in float64 and rounded to float32 as it is stored: (s / w).float()'s
            # values without its float64 temporary (tests/unit check it bit for bit).
            return {n: torch.div(s, self.total_weight, out=torch.empty(s.shape, dtype=torch.float32)) for n, s in self._sum.items()}
        # Where no site sent a value, the sum is 0 too: 0 / 1 keeps it 0.
        return {n: (s / torch.where(self._weight[n] > 0, self._weight[n], 1.0)).float() for n, s in self._sum.items()}
