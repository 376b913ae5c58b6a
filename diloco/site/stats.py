"""What a site's outer sync counts: traffic, retries, rounds that did not go as planned,
per-round hashes and timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SyncStats:
    bytes_up: int = 0
    bytes_down: int = 0
    reconnects: int = 0  # calls that failed because the coordinator could not be reached
    rejoins: int = 0  # times this site had to join again (evicted, or the coordinator forgot it)
    dropped_rounds: list[int] = field(default_factory=list)  # rounds committed without this site's push
    merged_rounds: list[int] = field(default_factory=list)  # rounds whose late push was merged into a later round
    diverged_rounds: list[int] = field(default_factory=list)  # rounds whose Δ was not finite: withheld, the site restarted from θ
    momentum_pulled: list[int] = field(default_factory=list)  # look-ahead sites: the rounds whose outer momentum came with a pull of θ (a join)
    uncounted: dict[int, str] = field(default_factory=dict)  # round -> why the coordinator took its push without counting it (or scaled it down)
    round_hashes: dict[int, str] = field(default_factory=dict)  # the site's θ hash after each round it applied
    # Seconds per applied round: computing Δ, encoding it, pushing, waiting for the round to
    # close, pulling (and decoding) the update, applying it and loading it into the model.
    timings: list[dict[str, float]] = field(default_factory=list)

    def retried(self) -> None:
        self.reconnects += 1
