"""The coordinator's options. Each field is checked once, here or in the config it is made
of (QuorumConfig, GuardConfig, CodecConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.codec import CodecConfig, codec_config
from diloco.coordinator.guard import GuardConfig
from diloco.coordinator.round_policy import QuorumConfig, RoundPolicy
from diloco.outer import RobustConfig, check_aggregate
from diloco.outer.fragments import check_split
from diloco.security.ids import check_site_id
from diloco.sync import FragmentEnd, RunSettings
from diloco.wire import MAX_CHUNK_BYTES


def _mechanics(settings: RunSettings) -> dict[str, object]:
    """The coordinator's round mechanics that follow from a run's settings."""
    sync, total = settings.sync, settings.total_rounds
    return {
        "total_rounds": total,
        "fragments": sync.fragments,
        "fragment_split": str(sync.split),
        "flush_rounds": total - settings.rounds * sync.fragments,
        "frozen_end": sync.fragments > 1 and sync.end == FragmentEnd.FREEZE,
        "codec_down": settings.codec_down,
        "error_feedback_down": settings.error_feedback,
    }


@dataclass(frozen=True)
class CoordinatorConfig:
    total_rounds: int
    min_sites: int = 1  # a round never closes with fewer pushes than this
    quorum: QuorumConfig = field(default_factory=QuorumConfig)  # leases, the round deadline, late pushes
    codec_down: CodecConfig | str = "fp32"  # the update's encoding (a config, or a wire name: made a CodecConfig here)
    error_feedback_down: bool = True  # carry the downlink codec's error into the next update
    aggregate: str = "mean"  # the round's average: mean | nonzero | trimmed_mean | median (diloco.outer.aggregate)
    chunk_bytes: int = MAX_CHUNK_BYTES
    max_concurrent_pushes: int = 2  # staging buffers; bounds decode memory independent of sites
    # The parameters cut into this many ranges of whole tensors, each a shard with its own θ,
    # outer optimizer, residual and sum, added and committed on its own thread (diloco.coordinator.shards)
    shards: int = 1
    keep_updates: int = 2  # committed updates kept for PullUpdate; older ones need PullGlobal
    snapshot_every: int = 0  # attach a copy of θ to every k-th RoundRecord (0: never; last round always)
    checkpoint_dir: str | None = None  # write an atomic checkpoint here after every commit, before publishing it
    guard: GuardConfig = field(default_factory=GuardConfig)  # the loss-spike guard (off by default)
    robust: RobustConfig = field(default_factory=RobustConfig)  # defences against poisoned or broken pushes (off by default)
    # The run's settings, handed out at Join (a site that states another value is refused,
    # naming the key); None: the coordinator owns none (a library coordinator: sites go by
    # their own). Given, the round mechanics below must agree with it (CoordinatorConfig.of_run).
    settings: RunSettings | None = None
    init_source: str = "the run's model config"  # where θ₀ comes from, named in Join refusals
    site_eval_every: int = 0  # evaluation by sites: they evaluate θ after every k-th round (0: the coordinator evaluates, or nobody)
    sites: tuple[str, ...] | None = None  # the site ids that may join (those the run issued credentials for); None: any valid id, up to max_sites
    max_sites: int | None = None  # sites=None: how many distinct site ids may join; None: no limit
    max_tokens_per_push: int = 2**40  # the largest averaging weight one push may declare
    staging_timeout_s: float = 30.0  # a push waits this long for a staging buffer, then is told to retry (resource_exhausted)
    # A push that has waited this long for its next chunk gives its staging buffer to a push
    # that waits for one, and is refused (resource_exhausted) when it goes on; inf: never.
    staging_stall_s: float = 2.0
    fragments: int = 1  # streaming DiLoCo: round r syncs fragment r mod F of the parameters (diloco.outer.fragments)
    fragment_split: str = "strided"  # how the parameters split into fragments: strided (whole layers) | balanced (equal sizes)
    # The last this many rounds are streaming's flush rounds (F − 1 with fragments): they average
    # the sites' last partial phases into θ without the outer step (OuterOptimizer.average_from).
    flush_rounds: int = 0
    # sync.end=freeze: each fragment's last round ends it (nothing trains after it), so under
    # the outer step's final average the last F rounds average, not only the last.
    frozen_end: bool = False
    # A whole pull's small chunks go in bundles (diloco.wire.bundles) of at most chunk_bytes:
    # few stream messages for a model of many small tensors. False: one message per chunk.
    bundle_downlink: bool = True

    def __post_init__(self) -> None:
        for name in ("total_rounds", "min_sites", "max_concurrent_pushes", "keep_updates", "max_tokens_per_push", "shards"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if not isinstance(self.quorum, QuorumConfig):
            raise ValueError(f"quorum={self.quorum!r}: must be a QuorumConfig")
        object.__setattr__(self, "codec_down", codec_config(self.codec_down))
        check_aggregate(self.aggregate)
        if self.sites is not None:
            object.__setattr__(self, "sites", tuple(check_site_id(s) for s in self.sites))
            if not self.sites:
                raise ValueError("sites=(): name at least one site id that may join")
        if self.max_sites is not None and not (isinstance(self.max_sites, int) and self.max_sites >= 1):
            raise ValueError(f"max_sites={self.max_sites!r}: must be null or an integer >= 1")
        if isinstance(self.fragments, bool) or not (isinstance(self.fragments, int) and self.fragments >= 1):
            raise ValueError(f"fragments={self.fragments!r}: must be an integer >= 1")
        why = check_split(self.fragment_split)
        if why is not None:
            raise ValueError(why)
        if isinstance(self.flush_rounds, bool) or not (isinstance(self.flush_rounds, int) and 0 <= self.flush_rounds < self.total_rounds):
            raise ValueError(f"flush_rounds={self.flush_rounds!r}: must be an integer in 0..total_rounds-1 ({self.total_rounds - 1})")
        if not isinstance(self.frozen_end, bool) or (self.frozen_end and (self.fragments == 1 or self.flush_rounds)):
            raise ValueError(
                f"frozen_end={self.frozen_end!r}: must be a bool, and True only with fragments > 1 and no flush rounds (fragments={self.fragments}, flush_rounds={self.flush_rounds})"
            )
        if self.fragments > 1 and self.quorum.late == "merge":
            raise ValueError(
                f"quorum.late=merge cannot be combined with fragments={self.fragments}: a late push belongs to another fragment than the open round's; use quorum.late=drop"
            )
        if not self.staging_timeout_s > 0:
            raise ValueError(f"staging_timeout_s={self.staging_timeout_s}: must be > 0")
        if not self.staging_stall_s > 0:
            raise ValueError(f"staging_stall_s={self.staging_stall_s}: must be > 0")
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={self.chunk_bytes}: must be in 1..{MAX_CHUNK_BYTES}")
        if self.settings is not None:
            derived = _mechanics(self.settings)
            wrong = [f"{k}={getattr(self, k)!r} (the settings': {v!r})" for k, v in derived.items() if getattr(self, k) != v]
            if wrong:
                raise ValueError("the round mechanics disagree with the run's settings: " + "; ".join(wrong))

    @staticmethod
    def of_run(settings: RunSettings, **options: object) -> CoordinatorConfig:
        """The config of a coordinator that owns ``settings``: its rounds, fragments and downlink
        follow from them; ``options``: the coordinator's own fields (quorum, checkpoint_dir, ...)."""
        return CoordinatorConfig(settings=settings, **_mechanics(settings), **options)  # type: ignore[arg-type]

    @property
    def bundle_bytes(self) -> int:
        """The most payload one bundle of the downlink carries (0: no bundles)."""
        return self.chunk_bytes if self.bundle_downlink else 0

    @property
    def policy(self) -> RoundPolicy:
        q = self.quorum
        return RoundPolicy(min_sites=self.min_sites, deadline=q.deadline, deadline_s=q.deadline_s, deadline_factor=q.deadline_factor)
