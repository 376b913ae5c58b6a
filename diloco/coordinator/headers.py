"""Every field of a push header checked on its own, before anything else looks at the push:
a pure function of the header and the run's bounds, tested field by field."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.security.ids import site_id_problem
from diloco.types import PushHeader

MAX_PARTS = 4096  # ranks of one sharded site
MAX_INNER_STEPS = 10**9
MAX_TRAIN_LOSS = 1e6  # nats per token; a reported loss above this is nonsense, not a diverged run
MAX_WITHHELD = 512  # characters of a withheld push's reason


@dataclass(frozen=True)
class HeaderBounds:
    total_rounds: int
    max_tokens: int  # tokens one push may declare (its averaging weight)


def header_problem(h: PushHeader, bounds: HeaderBounds) -> str | None:
    """Why ``h`` cannot be a push header of this run, or None. A round past the run's last is
    not a problem of the header (the coordinator says ``out_of_range``)."""
    why = site_id_problem(h.site_id)
    if why is not None:
        return why
    if h.round < 0:
        return f"round={h.round}: must be >= 0"
    if not 1 <= h.tokens <= bounds.max_tokens:
        return f"tokens={h.tokens}: must be in 1..{bounds.max_tokens} (coordinator.max_tokens_per_push)"
    if not 0 <= h.inner_steps <= MAX_INNER_STEPS:
        return f"inner_steps={h.inner_steps}: must be in 0..{MAX_INNER_STEPS}"
    if not 1 <= h.parts <= MAX_PARTS:
        return f"parts={h.parts}: must be in 1..{MAX_PARTS}"
    if not 0 <= h.part < h.parts:
        return f"part={h.part}: must be in 0..{h.parts - 1}"
    if not (math.isnan(h.train_loss) or abs(h.train_loss) <= MAX_TRAIN_LOSS):
        return f"train_loss={h.train_loss}: must be NaN (not reported) or at most {MAX_TRAIN_LOSS:g} in size"
    if h.withheld:
        if len(h.withheld) > MAX_WITHHELD or not h.withheld.isprintable():
            return f"withheld: a reason of at most {MAX_WITHHELD} printable characters (got {len(h.withheld)} characters)"
        if h.parts > 1:
            return f"withheld with parts={h.parts}: a site withholds its whole push, in one header (parts 1)"
    return None
