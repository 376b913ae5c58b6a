"""How a round ended for a site; the ranks of a sharded site agree on one outcome."""

from __future__ import annotations

from dataclasses import dataclass, fields

from diloco.errors import RemoteError


@dataclass(frozen=True)
class RoundOutcome:
    """``applied``: the push counted and its round's update was pulled and applied. Otherwise
    the site loads θ whole (``catch_up``) and goes on from the open round:

    * ``merged``: late, but merged into the open round (quorum.late=merge): it counted;
    * ``dropped``: the round was committed without the push: its work did not count;
    * ``rejoin``: the site was evicted (or forgotten): its leader joins again first;
    * ``catch_up`` alone: the push counted, but its update is gone (a coordinator restart).

    ``refused`` (with ``applied``): the coordinator judged the push and did not count it
    (robust.*); the site applies the round's update like the others, but its uplink residual
    does not move on (the Δ it came from did not count).

    ``why`` is the refusal behind it (None when applied or merged).
    """

    catch_up: bool = False
    merged: bool = False
    dropped: bool = False
    rejoin: bool = False
    refused: bool = False
    why: RemoteError | None = None

    @property
    def applied(self) -> bool:
        return not self.catch_up

    def bits(self) -> int:
        """The flags as bits, for the ranks' agreement (a bitwise or across ranks)."""
        return sum(1 << i for i, f in enumerate(_FLAGS) if getattr(self, f))

    def agreed(self, bits: int) -> RoundOutcome:
        """This outcome with the flags of every rank (``bits``: the union of their ``bits()``)."""
        return RoundOutcome(**{f: bool(bits >> i & 1) for i, f in enumerate(_FLAGS)}, why=self.why)


_FLAGS = tuple(f.name for f in fields(RoundOutcome) if f.type in (bool, "bool"))
APPLIED = RoundOutcome()


def refused_push(e: RemoteError) -> RoundOutcome | None:
    """The outcome of a push the coordinator refused for a reason the site can recover from:
    the round closed without it (aborted) or the site is no longer a member (it rejoins)."""
    if e.kind == "aborted":
        return RoundOutcome(catch_up=True, dropped=True, why=e)
    if e.kind == "failed_precondition":
        return RoundOutcome(catch_up=True, dropped=True, rejoin=True, why=e)
    return None


def refused_pull(e: RemoteError) -> RoundOutcome | None:
    """The outcome of a wait or pull refused after the push counted: the update is gone
    (not_found), or the site is no longer a member (it rejoins); either way it pulls θ."""
    if e.kind == "not_found":
        return RoundOutcome(catch_up=True, why=e)
    if e.kind == "failed_precondition":
        return RoundOutcome(catch_up=True, rejoin=True, why=e)
    return None
