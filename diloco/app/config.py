"""The typed configuration of a run. Entry points turn hydra's config into these; library
code takes only these (never a DictConfig). Every check names the field it rejects."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco.codec import CodecConfig, best_settings, codec_config
from diloco.coordinator.guard import GuardConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.data import DataConfig
from diloco.model import AnyModelConfig, ModelConfig, is_builtin, model_config
from diloco.observe.config import TensorBoardConfig
from diloco.observe.logs import LoggingConfig
from diloco.outer import OuterConfig, RobustConfig, check_aggregate
from diloco.outer.defaults import applies, auto_outer
from diloco.outer.eager import AHEAD_WEIGHT, EAGER_WEIGHT, check_eager_outer
from diloco.outer.fragments import check_split
from diloco.security.config import SecurityConfig
from diloco.site.inner import InnerConfig
from diloco.site.layouts.config import LayoutConfig, layout_config
from diloco.site.overlap import SyncSchedule
from diloco.wire.chunks import MAX_CHUNK_BYTES

MODES = ("diloco", "ddp", "single")
INIT_SOURCES = ("model", "site", "file")
EVAL_BY = ("auto", "coordinator", "sites")
DEVICES = ("auto", "cpu", "cuda")
# Layouts that cut the built-in transformer's own modules (heads, MLP halves, pipeline stages).
BUILTIN_ONLY_LAYOUTS = ("tp2", "tp2_fsdp2", "pp2")
OUTER_FROM_CODEC = (
    "name",
    "lr",
    "momentum",
    "nesterov",
    "momentum_warmup",
    "lr_decay",
    "lr_min_ratio",
    "final_average",
)  # outer fields the codec's best (or the auto rule) decides unless set
LOW_BIT_CODECS = ("int4", "e3m0", "topk2bit")  # their downlink defaults to int8


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


@dataclass(frozen=True)
class InitConfig:
    """Where θ₀ comes from (config group ``init``): ``model``, built from the run's model config;
    ``site``, the first site that joins uploads its parameters (the coordinator needs no model);
    ``file``, a ``.safetensors`` file or a ``torch.save`` state dict at ``path``."""

    source: str = "model"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.source not in INIT_SOURCES:
            raise ConfigError(f"init={self.source!r}: must be one of {', '.join(INIT_SOURCES)}")
        if self.source == "file" and not self.path:
            raise ConfigError("init=file needs init.path=FILE (a .safetensors file or a torch.save state dict)")
        if self.source != "file" and self.path is not None:
            raise ConfigError(f"init.path={self.path!r}: only init=file reads a file (init={self.source})")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run's math; the same for the coordinator and every site.

    mode: "diloco" (sites + coordinator), "ddp" (synchronous data parallel over ``sites``
    processes) or "single" (one worker). Each worker runs rounds × sync_every inner steps.
    """

    mode: str = "diloco"
    sites: int = 4
    sync_every: int = 50
    rounds: int = 10
    seed: int = 0
    model: AnyModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig | None = None  # None: the codec's best (codec.best_settings; DiLoCo's Nesterov SGD for dense codecs)
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)  # the coordinator's loss-spike guard
    robust: RobustConfig = field(default_factory=RobustConfig)  # the coordinator's defences against poisoned or broken pushes
    security: SecurityConfig = field(default_factory=SecurityConfig)  # the run's credentials (TLS, mutual TLS, tokens)
    codec: CodecConfig = field(default_factory=CodecConfig)  # uplink (pseudo-gradient) encoding
    codec_down: CodecConfig | None = None  # downlink (update) encoding; None: the same as codec
    error_feedback: bool = True  # carry each lossy codec's error into the next round (both links)
    inner_budget_s: float | None = None  # dynamic local steps: a site stops its inner phase after this many seconds (>= 1 step, <= H)
    error_feedback_decay: float | None = None  # β: a site adds β × its last residual to the next Δ; None: the codec's best (codec.best_settings)
    aggregate: str | None = None  # the coordinator's average of Δ: mean | nonzero (per coordinate, over the sites that sent it); None: the codec's best
    chunk_bytes: int = MAX_CHUNK_BYTES
    eval_every: int = 5  # evaluate θ on the held-out split every k rounds (and after the last)
    threads: int = 1  # torch intra-op threads per process
    layout: LayoutConfig = field(default_factory=LayoutConfig)  # how each site lays out its model over its ranks
    site_layouts: tuple[str, ...] | None = None  # per site, overriding layout.name (diloco-sim: one entry per site)
    init: InitConfig = field(default_factory=InitConfig)  # where θ₀ comes from
    eval_by: str = "auto"  # who evaluates θ: auto (the coordinator when it can, else the sites) | coordinator | sites
    device: str = "auto"  # where sites train: auto (cuda when available) | cpu | cuda (rank r of a site on cuda:LOCAL_RANK)
    compile: bool = False  # torch.compile the model each site trains
    tf32: bool = True  # CUDA: TensorFloat-32 for float32 matmuls and convolutions
    # Hiding the network (diloco.site.overlap): streaming fragments, overlap, eager outer steps.
    fragments: int = 1  # F: round r syncs fragment r mod F of the parameters, a round every H/F steps
    overlap_steps: int = 0  # τ: the site trains τ steps while a round is in flight, then merges it (τ < H/F)
    alpha: float | None = None  # the merge: local ← α·local + (1−α)·θ; None: 0.5 with overlap (Streaming DiLoCo's), else 0 (replace)
    merge: str = "alpha"  # alpha (the merge above) | delta: θ + the local steps trained since the push (docs/streaming.md)
    fragment_split: str = "strided"  # strided (whole layers, layer i in fragment i mod F) | balanced (equal sizes, tensors of every layer)
    fragment_end: str = "flush"  # flush (F − 1 flush rounds after the last step) | freeze (each fragment stops at its last push)
    # The H of the first rounds, growing to sync_every (e.g. [10, 25, 50] with sync_every=50):
    # frequent syncs early; every site follows it by round number (blocking DiLoCo only).
    sync_every_schedule: tuple[int, ...] | None = None
    outer_mode: str = "blocking"  # blocking | eager | delayed: eager/delayed overlap the whole sync with the next inner phase
    eager_weight: float | None = (
        None  # eager, merge=ahead: the weight of a site's own Δ standing in for the mean in flight; None: 0.5 (eager), 0 (ahead) (diloco.outer.eager)
    )
    streams: int = 1  # connection striping: a site's push and pull each over this many concurrent streams (TCP connections)
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # every process's log format: text lines, or JSON lines (logging.json)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)  # TensorBoard scalars under <run dir>/tb (tensorboard.enabled)

    def __post_init__(self) -> None:
        self._resolve_codecs()
        self._check_values()
        self._check_combinations()
        self._resolve_layouts()

    def _resolve_codecs(self) -> None:
        """codec and codec_down as CodecConfigs; what the run leaves unset, the codec's best."""
        for field_name in ("codec", "codec_down"):
            value = getattr(self, field_name)
            if value is None and field_name == "codec_down":
                continue
            try:
                # Strings and mappings (plain data) become a CodecConfig; bad ones fail here.
                object.__setattr__(self, field_name, codec_config(value))
            except ValueError as e:
                raise ConfigError(f"{field_name}={value!r}: {e}") from None
        # What the run leaves unset, the codec's measured best fills in (the outer step: the
        # rule of diloco.outer.defaults where it applies).
        for name, value in best_settings(self.codec.name).items():
            if getattr(self, name) is None:
                if name == "outer":
                    value = {**value, **(auto_outer(self.rounds) if applies(True, value, {}) else {})}  # type: ignore[dict-item]
                object.__setattr__(self, name, OuterConfig(**value) if name == "outer" else value)  # type: ignore[arg-type]

    def _check_values(self) -> None:
        """Each top-level field on its own (the sections check themselves)."""
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}: must be one of {', '.join(MODES)}")
        for name in ("sites", "sync_every", "rounds", "eval_every", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 1")
        if self.inner_budget_s is not None and not (isinstance(self.inner_budget_s, (int, float)) and self.inner_budget_s > 0):
            raise ConfigError(f"inner_budget_s={self.inner_budget_s!r}: must be null or a number of seconds > 0")
        if not (isinstance(self.error_feedback_decay, (int, float)) and 0.0 <= self.error_feedback_decay <= 1.0):
            raise ConfigError(f"error_feedback_decay={self.error_feedback_decay!r}: must be a number in [0, 1]")
        try:
            check_aggregate(self.aggregate)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.eval_by not in EVAL_BY:
            raise ConfigError(f"eval_by={self.eval_by!r}: must be one of {', '.join(EVAL_BY)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r}: must be one of {', '.join(DEVICES)}")
        for name in ("compile", "tf32"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be true or false")
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(f"chunk_bytes={self.chunk_bytes}: must be in 1..{MAX_CHUNK_BYTES}")
        if isinstance(self.streams, bool) or not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise ConfigError(f"streams={self.streams!r}: must be an integer in 1..64")
        if self.sync_every_schedule is not None:
            if isinstance(self.sync_every_schedule, (str, bytes)) or not hasattr(self.sync_every_schedule, "__iter__"):
                raise ConfigError(f"sync_every_schedule={self.sync_every_schedule!r}: must be a list of H values, e.g. [10, 25, {self.sync_every}]")
            object.__setattr__(self, "sync_every_schedule", tuple(self.sync_every_schedule))
            if len(self.sync_every_schedule) > self.rounds:
                raise ConfigError(f"sync_every_schedule has {len(self.sync_every_schedule)} entries: longer than the run's {self.rounds} rounds")
        why = self.schedule.problem()
        if why is not None:
            raise ConfigError(why)
        if self.alpha is None:
            object.__setattr__(self, "alpha", 0.5 if self.overlap_steps > 0 else 0.0)
        if self.merge not in ("alpha", "delta", "ahead"):
            raise ConfigError(
                f"merge={self.merge!r}: must be alpha (α·local + (1−α)·θ), delta (θ + the steps trained since the push) or ahead (delta, those steps from a look-ahead of the outer step)"
            )
        if isinstance(self.alpha, bool) or not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"alpha={self.alpha!r}: must be a number in [0, 1] (0: a landed fragment replaces the local one)")
        why = check_split(self.fragment_split)
        if why is not None:
            raise ConfigError(why)
        if self.eager_weight is not None and (
            isinstance(self.eager_weight, bool) or not (isinstance(self.eager_weight, (int, float)) and 0.0 <= self.eager_weight <= 1.0)
        ):
            raise ConfigError(f"eager_weight={self.eager_weight!r}: must be null (eager 0.5, ahead 0) or a number in [0, 1]")

    def _check_combinations(self) -> None:
        """Fields that are fine alone but cannot work together."""
        try:
            self.outer.schedule.check_length(self.rounds)  # type: ignore[union-attr]
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.quorum.min_sites is not None and self.quorum.min_sites > self.sites:
            raise ConfigError(f"quorum.min_sites={self.quorum.min_sites}: this run has only {self.sites} sites")
        if self.robust.aggregate != "mean" and self.aggregate == "nonzero":
            raise ConfigError(
                f"robust.aggregate={self.robust.aggregate} cannot be combined with aggregate=nonzero (a coordinate-wise statistic has no 'sites that sent it')"
            )
        if self.fragments > 1:
            for what, on in (
                ("quorum.late=merge", self.quorum.late == "merge"),
                ("guard.factor > 0", self.guard.factor > 0),
                ("robust.norm_ratio > 0", self.robust.norm_ratio > 0),
            ):
                if on:
                    raise ConfigError(
                        f"fragments={self.fragments} cannot be combined with {what}: it compares pushes of different rounds, which hold different fragments"
                    )
        if self.outer_mode == "eager" or self.merge == "ahead":
            try:
                check_eager_outer(self.outer, "outer_mode=eager" if self.outer_mode == "eager" else "merge=ahead")  # type: ignore[arg-type]
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.eager_weight is not None:
            raise ConfigError(
                f"eager_weight={self.eager_weight}: only for outer_mode=eager or merge=ahead (this run has outer_mode={self.outer_mode}, merge={self.merge})"
            )
        if self.merge == "ahead" and self.outer_mode != "blocking":
            raise ConfigError(
                f"merge=ahead looks ahead of a fragment's round while τ steps overlap it; outer_mode={self.outer_mode} starts whole phases from its own point: use merge=delta"
            )
        if self.init.source == "site" and self.eval_by == "coordinator":
            raise ConfigError("eval_by=coordinator: with init=site the coordinator does not know the model; use eval_by=auto or sites")
        if self.data.vocab > self.model.vocab_size:
            what = f"data.vocab_size={self.data.vocab}" if self.data.format == "tokens" else "256 (data.format=bytes)"
            raise ConfigError(
                f"model.vocab_size={self.model.vocab_size}: the model's embedding is smaller than the data's vocabulary, {what}: token ids would fall outside it"
            )

    def _resolve_layouts(self) -> None:
        """layout (and site_layouts) as LayoutConfigs, and what the model and θ₀ need of them."""
        try:
            object.__setattr__(self, "layout", layout_config(self.layout))
            if self.site_layouts is not None:
                names = tuple(str(n) for n in self.site_layouts)
                if len(names) != self.sites:
                    raise ValueError(f"site_layouts has {len(names)} entries for {self.sites} sites; give one per site")
                for n in names:
                    self.layout.named(n)
                object.__setattr__(self, "site_layouts", names)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.init.source == "site" and self.mode == "diloco" and all(self.layout_of(s).ranks > 1 for s in range(self.sites)):
            raise ConfigError("init=site: θ₀ is sent whole by a one-rank site, and every site here is a torchrun group; use init=model or init=file")
        if not is_builtin(self.model):
            for n in {self.layout_of(s).name for s in range(self.sites)} & set(BUILTIN_ONLY_LAYOUTS):
                raise ConfigError(f"layout={n}: cuts the built-in transformer's modules; model={self.model.name} runs with single, ddp2 or fsdp2")
            if self.layout.activation_checkpointing:
                raise ConfigError(f"layout.activation_checkpointing=true: wraps the built-in transformer's blocks; not available for model={self.model.name}")

    @property
    def downlink_codec(self) -> CodecConfig:
        """codec_down, or by default the uplink's codec when it has 8 or more bits per value
        (fp32, fp16, bf16, int8), else int8 with the uplink's zstd setting (int4, e3m0,
        topk2bit). Every site starts its next inner phase from what the downlink delivers,
        so its error costs more than an uplink's, which averaging over sites dilutes
        (docs/results.md), and the outer update is dense, so sparsifying it again would move
        only a few percent of θ per round."""
        if self.codec_down is not None:
            return self.codec_down
        if self.codec.name in LOW_BIT_CODECS:
            return CodecConfig(name="int8", zstd=self.codec.zstd, zstd_level=self.codec.zstd_level)
        return self.codec

    def layout_of(self, site: int) -> LayoutConfig:
        """The layout of site number ``site`` (0 .. sites-1)."""
        return self.layout.named(self.site_layouts[site]) if self.site_layouts is not None else self.layout

    @property
    def workers(self) -> int:
        return 1 if self.mode == "single" else self.sites

    @property
    def total_steps(self) -> int:
        """Inner steps per site over the run (rounds × H, less what a sync_every_schedule saves)."""
        return self.schedule.steps_before(self.rounds * self.fragments) if self.sync_every_schedule else self.rounds * self.sync_every

    @property
    def schedule(self) -> SyncSchedule:
        """When sites push and merge (diloco.site.overlap)."""
        return SyncSchedule(
            sync_every=self.sync_every,
            fragments=self.fragments,
            overlap_steps=self.overlap_steps,
            outer_mode=self.outer_mode,
            train_rounds=self.rounds * self.fragments,
            early=tuple(self.sync_every_schedule or ()),
            end=self.fragment_end,
        )

    @property
    def lookahead_weight(self) -> float:
        """The own Δ's weight in a look-ahead (eager, merge=ahead): eager_weight, or its mode's default."""
        if self.eager_weight is not None:
            return float(self.eager_weight)
        return EAGER_WEIGHT if self.outer_mode == "eager" else AHEAD_WEIGHT

    @property
    def sync_rounds(self) -> int:
        """The coordinator's rounds: ``rounds`` × F (one fragment each), and with fragments F − 1
        flush rounds after them (SyncSchedule.train_rounds); F = 1: ``rounds``."""
        return self.schedule.total_rounds(self.rounds)


def run_config_from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Builds a RunConfig from plain data (a resolved hydra config or JSON); unknown keys fail."""
    d = dict(d)
    try:
        model_d = dict(d.pop("model", {}) or {})
        model = model_config(str(model_d.pop("name", "tiny")), **model_d)
        data = _build(DataConfig, d.pop("data", {}), "data")
        inner = _build(InnerConfig, d.pop("inner", {}), "inner")
        outer = _outer_config(d.pop("outer", None), d.get("codec"), d.get("rounds", RunConfig.rounds))
        quorum = _build(QuorumConfig, d.pop("quorum", {}), "quorum")
        guard = _build(GuardConfig, d.pop("guard", {}), "guard")
        robust = _build(RobustConfig, d.pop("robust", {}), "robust")
        security = _build(SecurityConfig, d.pop("security", {}), "security")
        init = _build(InitConfig, d.pop("init", {}), "init")
        logging_config = _build(LoggingConfig, d.pop("logging", {}), "logging")
        tensorboard = _build(TensorBoardConfig, d.pop("tensorboard", {}), "tensorboard")
        sections = {
            "model": model, "data": data, "inner": inner, "outer": outer, "quorum": quorum, "guard": guard, "robust": robust, "security": security, "init": init,
            "logging": logging_config, "tensorboard": tensorboard,
        }  # fmt: skip
        return _build(RunConfig, {**d, **sections}, "")
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _outer_config(values: Mapping[str, Any] | None, codec: Any, rounds: Any = None) -> OuterConfig | None:
    """The ``outer`` section: None when absent (the codec's best, resolved by RunConfig); its
    null or missing fields are the codec's best (conf/run.yaml leaves name, lr, momentum,
    nesterov and momentum_warmup null), or where it applies the rule of diloco.outer.defaults
    for a run of ``rounds`` rounds; the others as given."""
    if values is None:
        return None
    try:
        best = best_settings(codec_config(codec if codec is not None else CodecConfig()).name)["outer"]
    except ValueError:
        best = {}  # a bad codec: RunConfig names it
    given = {k: v for k, v in dict(values).items() if v is not None}
    if applies(given.get("auto", True), best, given) and isinstance(rounds, int) and not isinstance(rounds, bool):
        best = {**best, **auto_outer(rounds)}  # type: ignore[dict-item]
    return _build(OuterConfig, {**best, **given}, "outer")  # type: ignore[dict-item]


def run_config_defaults() -> dict[str, Any]:
    """The defaults as plain data, with what the codec decides left null (as in
    conf/run.yaml): the base to put overrides on, so that ``codec=...`` still brings its best."""
    d = run_config_to_dict(RunConfig())
    d.update(aggregate=None, error_feedback_decay=None)
    d["outer"].update({k: None for k in OUTER_FROM_CODEC})  # the codec's best, or the auto rule
    return d


def _build(cls: type, values: Mapping[str, Any] | None, prefix: str) -> Any:
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain, JSON-able data that run_config_from_dict turns back into ``cfg``."""
    out = dataclasses.asdict(cfg)
    out["outer"]["kwargs"] = dict(cfg.outer.kwargs)  # type: ignore[union-attr]
    return out
