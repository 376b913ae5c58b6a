"""The coordinator's options. Each field is checked once, here or in the config it is made
of (QuorumConfig, GuardConfig, CodecConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.codec import CodecConfig, codec_config
from diloco.coordinator.guard import GuardConfig
from diloco.coordinator.round_policy import QuorumConfig, RoundPolicy
from diloco.outer import check_aggregate
from diloco.wire import MAX_CHUNK_BYTES


@dataclass(frozen=True)
class CoordinatorConfig:
    total_rounds: int
    min_sites: int = 1  # a round never closes with fewer pushes than this
    quorum: QuorumConfig = field(default_factory=QuorumConfig)  # leases, the round deadline, late pushes
    codec_down: CodecConfig | str = "fp32"  # the update's encoding (a config, or a wire name: made a CodecConfig here)
    error_feedback_down: bool = True  # carry the downlink codec's error into the next update
    aggregate: str = "mean"  # mean | nonzero: see WeightedMean
    chunk_bytes: int = MAX_CHUNK_BYTES
    max_concurrent_pushes: int = 2  # staging buffers; bounds decode memory independent of sites
    keep_updates: int = 2  # committed updates kept for PullUpdate; older ones need PullGlobal
    snapshot_every: int = 0  # attach a copy of θ to every k-th RoundRecord (0: never; last round always)
    checkpoint_dir: str | None = None  # write an atomic checkpoint here after every commit, before publishing it
    guard: GuardConfig = field(default_factory=GuardConfig)  # the loss-spike guard (off by default)
    sync_every: int | None = None  # the run's H: a site that says another one is refused at Join
    codec_up: str | None = None  # the uplink codec's wire name: a site that says another one is refused
    init_source: str = "the run's model config"  # where θ₀ comes from, named in Join refusals
    site_eval_every: int = 0  # evaluation by sites: they evaluate θ after every k-th round (0: the coordinator evaluates, or nobody)

    def __post_init__(self) -> None:
        for name in ("total_rounds", "min_sites", "max_concurrent_pushes", "keep_updates"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if not isinstance(self.quorum, QuorumConfig):
            raise ValueError(f"quorum={self.quorum!r}: must be a QuorumConfig")
        object.__setattr__(self, "codec_down", codec_config(self.codec_down))
        check_aggregate(self.aggregate)
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={self.chunk_bytes}: must be in 1..{MAX_CHUNK_BYTES}")

    @property
    def policy(self) -> RoundPolicy:
        q = self.quorum
        return RoundPolicy(min_sites=self.min_sites, deadline=q.deadline, deadline_s=q.deadline_s, deadline_factor=q.deadline_factor)
