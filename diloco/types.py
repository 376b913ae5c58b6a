"""Domain types that cross the wire. The transport converts them to and from protobuf
(diloco/transport/serde.py); everything else in the project uses only these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco.boxes import Box


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one parameter: the unit of a model fingerprint."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"


@dataclass(frozen=True)
class Chunk:
    """One encoded piece of one tensor: elements [offset, offset + numel) of its flat view."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int
    codec: str
    payload: bytes
    box_start: tuple[int, ...] = ()  # a slice of the tensor (see diloco.boxes); empty: the whole tensor,
    box_shape: tuple[int, ...] = ()  # else offset and numel count elements of the box's flat view

    @property
    def box(self) -> Box:
        """The part of the tensor this chunk's offset/numel refer to."""
        return Box(self.box_start, self.box_shape) if self.box_shape or self.box_start else Box.whole(self.shape)


@dataclass(frozen=True)
class SiteEval:
    """A site's held-out loss of the global θ after ``round`` (evaluation by sites)."""

    round: int
    loss: float  # nats per token
    tokens: int  # > 0: the loss is the mean over this many tokens


@dataclass(frozen=True)
class JoinRequest:
    """What a site says when it joins: who it is, what it is (its model's fingerprint, whether
    it can send θ₀), and the run settings its own configuration states explicitly."""

    site_id: str
    specs: tuple[TensorSpec, ...]
    can_upload: bool = False  # it can send its whole parameters as θ₀ (init=site)
    # Dotted key -> value (diloco.sync.RunSettings.flat): the coordinator refuses another value
    # than the run's, naming the key. Empty: the site takes the run's settings as they are.
    stated: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PushHeader:
    """What a site says about its pseudo-gradient before the chunks follow."""

    site_id: str
    round: int
    tokens: int  # tokens processed in the round: the site's averaging weight
    train_loss: float  # mean inner loss over the round, nats per token
    inner_steps: int
    part: int = 0  # a sharded site pushes `parts` parts (one per rank), each with its own slices
    parts: int = 1
    eval: SiteEval | None = None  # the site's evaluation of the global θ of an earlier round
    # Not empty: the site has no Δ for this round, and why (lost, or its inner phase went
    # wrong); no chunks follow, the round goes on without it and the site pulls as usual.
    withheld: str = ""


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    duplicate: bool
    round: int
    payload_bytes: int
    merged_into: int = 0  # > 0: a late push merged into that open round (quorum.late=merge)
    refused: str = ""  # not empty: judged (robust.*) and not counted; why
    clipped: str = ""  # not empty: counted scaled down (robust.action=clip); why


@dataclass(frozen=True)
class JoinInfo:
    total_rounds: int
    run_id: str
    lease_s: float = 60.0  # the coordinator evicts a site silent this long
    upload_init: bool = False  # init=site: this site must upload its parameters as θ₀, then pull
    eval_every: int = 0  # evaluation by sites: evaluate the global θ after every k-th round (0: never)
    # The run's settings every site uses (diloco.sync.RunSettings.to_dict); None: the
    # coordinator owns none (a library coordinator) and the site goes by its own.
    settings: Mapping[str, Any] | None = None
    fragments: tuple[tuple[str, ...], ...] = ()  # the parameters' split into fragments; (): not known yet (init=site)


@dataclass(frozen=True)
class RoundStatus:
    committed_rounds: int  # rounds 0 .. committed_rounds - 1 are committed; round committed_rounds is open
    total_rounds: int
    global_sha256: str
