"""Eager outer steps (arXiv 2502.12996): the next inner phase starts from a look-ahead of the
outer step still in flight.

Under ``sync.mode=eager`` a site pushes round k's Δ_k and starts the next inner phase without
waiting for the round; its mean lands one phase later. The paper's worker steps its own outer
optimizer at once with a stand-in for the missing mean (its own fresh Δ_k and the other
workers' Δ_{k−1}, each weighted 1/N), so every worker's outer state is its own.

Here θ stays one sequence, the coordinator's, bit-identical on every site; only the start
point of the site's next phase is its own: θ_k moved by outer step k *as the coordinator will
take it* (the rates of round k, its momentum buffer as it stands), with x_k = w·Δ_k(own) in
place of the mean. A site knows the coordinator's momentum buffer without being sent it: the
update ũ_r it applies each round is the outer step's, so for torch's SGD (plain, heavy ball or
Nesterov) ũ_r and the rates of round r give that round's mean g_r and the buffer after it
(``observe``), the same recursion the optimizer ran.

So with one site and w = 1 every phase starts where blocking DiLoCo's would (up to the
codecs' rounding; tests/unit/test_eager_share.py), and the momentum, which carries each mean
over the rounds after it (a gain of about lr/(1 − μ)), is in the look-ahead. With N sites and
w = 1 the sites' start points scatter around blockings by (1 + μ)·lr times each site's own
deviation from the mean; w < 1 trades that scatter for a lag. The paper's stand-in (the
others' Δ_{k−1} added back, w = 1/N) and a w fitted each round both measured worse than a
fixed w (docs/streaming.md), so the stand-in is the site's own Δ alone.

``merge=ahead`` (streaming with overlap) uses the same look-ahead for one fragment's round: the
τ steps trained while it is in flight start from the fragment moved by its outer step as far
as the site can foresee it (weight 0 by default: the momentum alone). With fragments each
parameter keeps its own buffer, and round r is outer step r // F, as the coordinator counts
them. The rounds the coordinator averages without the outer step (streaming's flush rounds,
the last round of training under ``outer.final_average``: ``averaged_from``) are looked ahead
and observed here as outer steps; no inner step trains after them, and their buffers are read
by no later round.

When the site lacks a piece (a round it caught up on without its update: the buffer is
carried by the momentum alone), the look-ahead is what it has: only the start point is
affected, never θ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from diloco.outer.optimizer import OuterConfig

EAGER_WEIGHT = 0.5  # w: the best of 0.25 (with the paper's others), 0.5, 1 and a fitted w at 10 rounds (docs/streaming.md)
AHEAD_WEIGHT = 0.0  # merge=ahead's w: the momentum alone (τ = 5: w = 0.5 cost +5.6% bpb, w = 0 +1.8%; docs/streaming.md)
ALLOWED_KWARGS = ("foreach",)  # anything else (weight_decay, dampening, maximize) changes the step's rule


def check_eager_outer(cfg: OuterConfig, what: str = "sync.mode=eager") -> None:
    """Refuses an outer step the look-ahead cannot follow, naming the field (``what``: the
    setting that needs the look-ahead)."""
    if cfg.name != "SGD":
        raise ValueError(f"{what} follows the outer step's momentum from the updates: it needs outer.name=SGD (this run has outer.name={cfg.name})")
    extra = sorted(set(cfg.kwargs) - set(ALLOWED_KWARGS))
    if extra:
        raise ValueError(f"{what} cannot follow an outer step with outer.kwargs.{extra[0]}={cfg.kwargs[extra[0]]!r}")


class EagerStart:
    """A site's look-ahead of the outer step in flight (tensors: name -> float32, this rank's
    slices). ``observe`` each landed round's update, in order; ``offset`` after each push."""

    def __init__(self, cfg: OuterConfig, steps: int, weight: float, fragments: int = 1) -> None:
        check_eager_outer(cfg)
        if not 0 <= weight <= 1:
            raise ValueError(f"eager weight={weight}: must be in [0, 1]")
        # steps: the outer steps of the run; with F fragments round r is outer step r // F of
        # ceil(rounds / F), as the coordinator's optimizer counts them.
        self.cfg, self.steps, self.weight, self.fragments = cfg, max(int(steps), 1), float(weight), max(int(fragments), 1)
        self.nesterov = cfg.nesterov and cfg.momentum > 0  # as OuterConfig.build makes the optimizer
        # The coordinator's momentum buffer per parameter (absent: torch has made none for it
        # yet; with fragments each parameter's buffer starts at its own fragment's round).
        self.buffer: dict[str, torch.Tensor] = {}
        self.mean: tuple[int, dict[str, torch.Tensor]] | None = None  # (round, its mean Δ) of the last round observed

    def _rates(self, k: int) -> tuple[float, float]:
        settings = self.cfg.settings_at(k // self.fragments, self.steps)
        return float(settings.get("lr", self.cfg.lr)), float(settings.get("momentum", self.cfg.momentum))

    def _step(self, g: dict[str, torch.Tensor], k: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """torch's SGD step direction for gradient ``g`` at round ``k`` (before × −lr), and the
        momentum buffers of ``g``'s parameters after it."""
        _, mu = self._rates(k)
        if mu == 0:
            return g, {}
        buffer = {n: g[n].clone() if n not in self.buffer else self.buffer[n] * mu + g[n] for n in g}
        return ({n: g[n] + mu * buffer[n] for n in g} if self.nesterov else buffer), buffer

    def observe(self, k: int, update: Mapping[str, torch.Tensor]) -> None:
        """Round ``k`` landed with update ũ_k (its fragment's parameters): recovers its mean Δ
        and the buffers after it."""
        lr, mu = self._rates(k)
        g = {}
        for n, value in update.items():
            v = -value.float() / lr  # the step direction
            if mu == 0:
                g[n] = v
            elif n not in self.buffer:  # torch makes the buffer from this gradient: direction (1 + μ)·g (Nesterov) or g
                g[n] = v / (1 + mu) if self.nesterov else v
            elif self.nesterov:  # direction = g + μ·(μ·b + g)
                g[n] = (v - mu * mu * self.buffer[n]) / (1 + mu)
            else:  # direction = μ·b + g
                g[n] = v - mu * self.buffer[n]
        _, after = self._step(g, k)
        self.buffer.update(after)
        self.mean = (k, g)

    def follow(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """The coordinator's momentum buffers as pulled with θ (after a restart or a catch-up):
        the look-ahead goes on from them exactly. A zero buffer and an absent one give the
        same next step (torch's SGD starts a buffer as the gradient itself)."""
        self.buffer = {n: b.float().clone() for n, b in buffers.items()}
        self.mean = None

    def missed(self, k: int, names: Iterable[str] | None = None) -> None:
        """Round ``k`` landed but the site did not see its update (it caught up on θ whole): the
        buffers of its parameters (``names``; None: all) go on by the momentum alone, and no
        mean is known."""
        _, mu = self._rates(k)
        if mu > 0:
            for n in list(self.buffer) if names is None else [n for n in names if n in self.buffer]:
                self.buffer[n] = self.buffer[n] * mu
        self.mean = None

    def offset(self, k: int, own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """After pushing round ``k`` with the site's Δ_k: the look-ahead θ_k → start point, as an
        offset to add to θ_k (the site's θ holds rounds 0 .. k−1)."""
        direction, _ = self._step({n: self.weight * d.float() for n, d in own.items()}, k)
        lr, _ = self._rates(k)
        return {n: -lr * v for n, v in direction.items()}
