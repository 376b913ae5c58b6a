"""The typed configuration of a run. Entry points turn hydra's config into these; library
code takes only these (never a DictConfig). Every check names the field it rejects."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from diloco.codec import CodecConfig, best_settings, codec_config
from diloco.coordinator.guard import GuardConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.data import DataConfig
from diloco.fields import setting
from diloco.model import AnyModelConfig, HFModelConfig, ModelConfig, is_builtin, model_config
from diloco.observe.config import TensorBoardConfig
from diloco.observe.logs import LoggingConfig
from diloco.outer import OuterConfig, RobustConfig, check_aggregate
from diloco.outer.defaults import STEP_KEYS, OuterSection, outer_config, resolve_outer
from diloco.security.config import SecurityConfig
from diloco.site.inner import InnerConfig
from diloco.site.layouts.config import LayoutConfig, ParallelConfig, ParallelDims, layout_config, parallel_config
from diloco.sync import RunSettings, SyncConfig, SyncSchedule
from diloco.wire.chunks import MAX_CHUNK_BYTES

MODES = ("diloco", "ddp", "single")
INIT_SOURCES = ("model", "site", "file")
EVAL_BY = ("auto", "coordinator", "sites")
DEVICES = ("auto", "cpu", "cuda")
HF_LLAMA = "diloco.site.layouts.hf_llama:parallelize"  # model=hf's ready tensor parallelism for Llama-style models
LOW_BIT_CODECS = ("int4", "e3m0", "topk2bit")  # their downlink defaults to int8


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


@dataclass(frozen=True)
class InitConfig:
    """Where θ₀ comes from (config group ``init``): ``model``, built from the run's model config;
    ``site``, the first site that joins uploads its parameters (the coordinator needs no model);
    ``file``, a ``.safetensors`` file or a ``torch.save`` state dict at ``path``."""

    source: str = setting("model", doc="model (built from the run's model config) | site (the first site uploads its parameters) | file (init.path)")
    path: str | None = setting(None, doc="init=file: a .safetensors file or a torch.save state dict")

    def __post_init__(self) -> None:
        if self.source not in INIT_SOURCES:
            raise ConfigError(f"init={self.source!r}: must be one of {', '.join(INIT_SOURCES)}")
        if self.source == "file" and not self.path:
            raise ConfigError("init=file needs init.path=FILE (a .safetensors file or a torch.save state dict)")
        if self.source != "file" and self.path is not None:
            raise ConfigError(f"init.path={self.path!r}: only init=file reads a file (init={self.source})")


# Keys of earlier releases -> where each went (the error names the new one).
RENAMED = {
    "sync_every": "sync.every",
    "sync_every_schedule": "sync.schedule",
    "inner_budget_s": "sync.budget_s",
    "fragments": "sync.fragments",
    "fragment_split": "sync.split",
    "fragment_end": "sync.end",
    "overlap_steps": "sync.overlap",
    "alpha": "sync.local_weight (with sync.merge=mix)",
    "merge": "sync.merge (alpha is now mix)",
    "outer_mode": "sync.mode",
    "eager_weight": "sync.lookahead_weight",
    "streams": "sync.streams",
    "robust.aggregate": "aggregate (mean | nonzero | trimmed_mean | median)",
    "outer.auto": "outer.rule (measured | diloco); each outer field now overrides alone",
    "layout.microbatches": "parallel.pp_microbatches",
}


def renamed_problem(keys: Iterable[str]) -> str | None:
    """The first key of an earlier release among ``keys`` (dotted), naming where it went."""
    for key in keys:
        if key in RENAMED:
            return f"{key}: renamed, use {RENAMED[key]} (docs/config.md)"
    return None


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run's math; the same for the coordinator and every site.

    Each worker runs rounds × sync.every inner steps. Null fields that the codec decides
    (``aggregate``, ``error_feedback_decay``, ``codec_down``, the ``outer`` step) are resolved
    when the config is made: the object holds what the run uses, and config.json records it.
    """

    mode: str = setting("diloco", doc="diloco (sites + a coordinator) | ddp (synchronous data parallel, an all-reduce every step) | single (one worker)")
    sites: int = setting(4, doc="DiLoCo sites (mode=ddp: ranks)")
    rounds: int = setting(10, doc="outer rounds; each site trains rounds × sync.every inner steps")
    seed: int = setting(0, doc="the model's initialisation and the data order")
    sync: SyncConfig = setting(doc="when and how a site exchanges with the coordinator (the sync.* keys)", factory=SyncConfig)
    model: AnyModelConfig = setting(doc="the model every site trains (config group model: tiny small base custom hf)", factory=ModelConfig)
    data: DataConfig = setting(doc="the text (or token file) and its batches", factory=DataConfig)
    inner: InnerConfig = setting(doc="each site's inner optimizer: AdamW with warm-up and cosine decay over the run's steps", factory=InnerConfig)
    outer: OuterSection = setting(doc="the coordinator's outer step; every null field takes the rule's value (diloco.outer.defaults)", factory=OuterSection)
    quorum: QuorumConfig = setting(doc="who a round waits for: leases, the quorum, deadlines, late and withheld pushes", factory=QuorumConfig)
    guard: GuardConfig = setting(doc="the coordinator's loss-spike guard", factory=GuardConfig)
    robust: RobustConfig = setting(doc="the coordinator's defences against poisoned or broken pushes", factory=RobustConfig)
    security: SecurityConfig = setting(doc="the run's credentials (diloco-certs): TLS, mutual TLS, tokens", factory=SecurityConfig)
    codec: CodecConfig = setting(doc="the uplink's encoding of Δ (config group codec: fp32 fp16 bf16 int8 int4 e3m0 topk2bit)", factory=CodecConfig)
    codec_down: CodecConfig | None = setting(
        None, doc="the downlink's encoding of the update: a name (int8, int4+zstd) or {name: ..., block: ...}; null: the uplink's, int8 below 8 bits"
    )
    error_feedback: bool = setting(True, doc="a lossy codec's error is carried into the next round (sites: the uplink; the coordinator: the downlink)")
    error_feedback_decay: float | None = setting(
        None, doc="β: a site adds β × its last uplink residual to its next Δ; null: the codec's best (topk2bit 0.8, else 1)"
    )
    aggregate: str | None = setting(
        None,
        doc="the coordinator's average of a round's Δ: mean | nonzero (per coordinate, over the sites that sent it) | trimmed_mean | median (coordinate-wise, keep every push); null: the codec's best",
    )
    chunk_bytes: int = setting(MAX_CHUNK_BYTES, doc="the largest payload of one gRPC message (at most 1 MiB)")
    eval_every: int = setting(5, doc="evaluate θ on the held-out split every k rounds, and after the last")
    threads: int = setting(1, doc="torch threads per process")
    layout: LayoutConfig = setting(
        doc="how each site spreads its model over its ranks (config group layout: single ddp2 fsdp2 tp2 pp2 tp2_fsdp2)", factory=LayoutConfig
    )
    parallel: ParallelConfig = setting(
        doc="the degrees of parallelism inside each site: dp_replicate × dp_shard × tp × pp = its ranks; null: the layout name's", factory=ParallelConfig
    )
    site_layouts: tuple[str, ...] | None = setting(
        None, doc="one layout name per site, overriding layout.name (e.g. [fsdp2, ddp2, single]); the parallel.* degrees set apply to every site"
    )
    init: InitConfig = setting(doc="where θ₀ comes from (config group init: model site file)", factory=InitConfig)
    eval_by: str = setting("auto", doc="who evaluates θ: auto (the coordinator if it can build the model, else the sites) | coordinator | sites")
    device: str = setting("auto", doc="where sites train: auto (cuda when available) | cpu | cuda (rank r on cuda:LOCAL_RANK)")
    compile: bool = setting(False, doc="torch.compile the model each site trains")
    tf32: bool = setting(True, doc="CUDA: TensorFloat-32 for float32 matmuls (inner.bf16 for bf16 autocast)")
    logging: LoggingConfig = setting(doc="every process's log lines", factory=LoggingConfig)
    tensorboard: TensorBoardConfig = setting(doc="TensorBoard scalars under <run dir>/tb", factory=TensorBoardConfig)

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
        best = best_settings(self.codec.name)
        for name in ("aggregate", "error_feedback_decay"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, best[name])
        try:
            section = self.outer if isinstance(self.outer, OuterSection) else _section(OuterSection, self.outer, "outer")
            object.__setattr__(self, "outer", resolve_outer(section, self.rounds if _is_int(self.rounds) else 1, best["outer"]))  # type: ignore[arg-type]
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_values(self) -> None:
        """Each top-level field on its own (the sections check themselves)."""
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}: must be one of {', '.join(MODES)}")
        for name in ("sites", "rounds", "eval_every", "threads"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 1")
        if not isinstance(self.sync, SyncConfig):
            object.__setattr__(self, "sync", _section(SyncConfig, self.sync, "sync"))
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
        if self.sync.schedule is not None and len(self.sync.schedule) > self.rounds:
            raise ConfigError(f"sync.schedule has {len(self.sync.schedule)} entries: longer than the run's {self.rounds} rounds")

    def _check_combinations(self) -> None:
        """Fields that are fine alone but cannot work together."""
        try:
            self.outer_step.schedule.check_length(self.rounds)
            self.settings  # noqa: B018 - checks what the sites share (the look-ahead's outer step)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.quorum.min_sites is not None and self.quorum.min_sites > self.sites:
            raise ConfigError(f"quorum.min_sites={self.quorum.min_sites}: this run has only {self.sites} sites")
        if self.aggregate in ("trimmed_mean", "median") and self.quorum.withheld == "zero":
            raise ConfigError(f"quorum.withheld=zero adds a zero Δ to a weighted mean; aggregate={self.aggregate} is unweighted: use quorum.withheld=skip")
        if self.sync.fragments > 1:
            for what, on in (
                ("quorum.late=merge", self.quorum.late == "merge"),
                ("guard.factor > 0", self.guard.factor > 0),
                ("robust.norm_ratio > 0", self.robust.norm_ratio > 0),
            ):
                if on:
                    raise ConfigError(
                        f"sync.fragments={self.sync.fragments} cannot be combined with {what}: it compares pushes of different rounds, which hold different fragments"
                    )
        if self.init.source == "site" and self.eval_by == "coordinator":
            raise ConfigError("eval_by=coordinator: with init=site the coordinator does not know the model; use eval_by=auto or sites")
        if self.data.vocab > self.model.vocab_size:
            what = f"data.vocab_size={self.data.vocab}" if self.data.format == "tokens" else "256 (data.format=bytes)"
            raise ConfigError(
                f"model.vocab_size={self.model.vocab_size}: the model's embedding is smaller than the data's vocabulary, {what}: token ids would fall outside it"
            )

    def _resolve_layouts(self) -> None:
        """layout, parallel and site_layouts typed, and every site's degrees checked against the
        model, the batch and θ₀."""
        try:
            object.__setattr__(self, "layout", layout_config(self.layout))
            object.__setattr__(self, "parallel", parallel_config(self.parallel))
            if self.site_layouts is not None:
                names = tuple(str(n) for n in self.site_layouts)
                if len(names) != self.sites:
                    raise ValueError(f"site_layouts has {len(names)} entries for {self.sites} sites; give one per site")
                for n in names:
                    self.layout.named(n)
                object.__setattr__(self, "site_layouts", names)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        every = {self.layout_of(s) for s in range(self.sites)}
        if self.init.source == "site" and self.mode == "diloco" and all(d.ranks != 1 for d in every):
            raise ConfigError("init=site: θ₀ is sent whole by a one-rank site, and every site here is a torchrun group; use init=model or init=file")
        for dims in sorted(every, key=lambda d: d.name):
            self._check_dims(dims)

    def _check_dims(self, dims: ParallelDims) -> None:
        """What the model and the batch need of one site's degrees; ConfigError naming the keys."""
        model = self.model
        if is_builtin(model):
            assert isinstance(model, ModelConfig)
            for size in ("n_heads", "mlp_hidden"):
                if getattr(model, size) % dims.tp:
                    raise ConfigError(f"{dims.key('tp')}: must divide model.{size}={getattr(model, size)} (each tensor-parallel rank computes a part of them)")
            if dims.pp > model.n_layers:
                raise ConfigError(f"{dims.key('pp')}: more pipeline stages than model.n_layers={model.n_layers} (each stage runs one block or more)")
        else:
            self._check_user_model(dims)
        try:
            dims.check_batch(self.data.batch_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_user_model(self, dims: ParallelDims) -> None:
        """model=custom and model=hf: no pipeline stages, tensor parallelism by model.parallelize."""
        model = self.model
        if dims.pp > 1:
            raise ConfigError(f"{dims.key('pp')}: pipeline stages cut the built-in transformer's blocks; model={model.name} runs with pp=1")
        if dims.tp > 1 and getattr(model, "parallelize", None) is None:
            raise ConfigError(
                f"{dims.key('tp')}: model={model.name} needs model.parallelize=package.module:function, which applies tensor parallelism "
                "to the model over a device mesh (model=hf, Llama-style: model.parallelize=diloco.site.layouts.hf_llama:parallelize)"
            )
        if dims.activation_checkpointing:
            raise ConfigError(f"layout.activation_checkpointing=true: wraps the built-in transformer's blocks; not available for model={model.name}")
        if dims.tp > 1 and isinstance(model, HFModelConfig) and model.parallelize == HF_LLAMA:
            from diloco.site.layouts.hf_llama import tp_problem

            why = tp_problem(model.config, dims.tp)
            if why is not None:
                raise ConfigError(f"{dims.key('tp')}: {why}")

    @property
    def outer_step(self) -> OuterConfig:
        """The coordinator's outer step, resolved from the ``outer`` section."""
        return outer_config(self.outer)

    @property
    def downlink_codec(self) -> CodecConfig:
        """codec_down, or by default the uplink's codec when it has 8 or more bits per value
        (fp32, fp16, bf16, int8), else int8 with the uplink's zstd setting (int4, e3m0,
        topk2bit). Every site starts its next inner phase from what the downlink delivers,
        so its error costs more than an uplink's, which averaging over sites dilutes
        (docs/measurements/codecs.md), and the outer update is dense, so sparsifying it again
        would move only a few percent of θ per round."""
        if self.codec_down is not None:
            return self.codec_down
        if self.codec.name in LOW_BIT_CODECS:
            return CodecConfig(name="int8", zstd=self.codec.zstd, zstd_level=self.codec.zstd_level)
        return self.codec

    @property
    def settings(self) -> RunSettings:
        """What every site of the run shares (the coordinator hands it out at Join)."""
        return RunSettings(
            rounds=self.rounds, sync=self.sync, codec=self.codec, codec_down=self.downlink_codec, error_feedback=self.error_feedback,
            error_feedback_decay=float(self.error_feedback_decay), outer=self.outer,
        )  # fmt: skip

    def layout_of(self, site: int) -> ParallelDims:
        """The degrees of site number ``site`` (0 .. sites-1): its layout name's, with the
        ``parallel`` section's on top."""
        layout = self.layout.named(self.site_layouts[site]) if self.site_layouts is not None else self.layout
        return ParallelDims.of(layout, self.parallel)

    @property
    def workers(self) -> int:
        return 1 if self.mode == "single" else self.sites

    @property
    def schedule(self) -> SyncSchedule:
        """When sites push and merge, round by round."""
        return SyncSchedule.of(self.sync, self.rounds)

    @property
    def total_steps(self) -> int:
        """Inner steps per site over the run (rounds × H, less what sync.schedule saves)."""
        return self.settings.total_steps

    @property
    def sync_rounds(self) -> int:
        """The coordinator's rounds: ``rounds`` × F (one fragment each), and with fragments F − 1
        flush rounds after them unless they freeze; F = 1: ``rounds``."""
        return self.schedule.total_rounds(self.rounds)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def run_config_from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Builds a RunConfig from plain data (a resolved hydra config or JSON); unknown keys fail,
    and a key of an earlier release names its new place."""
    d = dict(d)
    why = renamed_problem(flatten_keys(d))
    if why is not None:
        raise ConfigError(why)
    try:
        model_d = dict(d.pop("model", {}) or {})
        model = model_config(str(model_d.pop("name", "tiny")), **model_d)
        sections = {"model": model}
        for name, cls in SECTIONS.items():
            if name in d:
                sections[name] = _build(cls, d.pop(name), name)
        return _build(RunConfig, {**d, **sections}, "")
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def flatten_keys(d: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every key of nested mappings, dotted (a section's own key too)."""
    out = []
    for k, v in d.items():
        out.append(prefix + str(k))
        if isinstance(v, Mapping):
            out += flatten_keys(v, f"{prefix}{k}.")
    return out


def run_config_defaults() -> dict[str, Any]:
    """The defaults as plain data, with what the codec decides left null (as in
    conf/run.yaml): the base to put overrides on, so that ``codec=...`` still brings its best."""
    d = run_config_to_dict(RunConfig())
    d.update(aggregate=None, error_feedback_decay=None)
    d["outer"].update({k: None for k in STEP_KEYS})  # the codec's best, or the rule's
    d["sync"]["local_weight"] = None  # by sync.overlap
    return d


def _section(cls: type, values: object, prefix: str) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{prefix}: must be a mapping of its fields, not {type(values).__name__}")
    return _build(cls, values, prefix)


def _build(cls: type, values: Mapping[str, Any] | None, prefix: str) -> Any:
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


# The run's sections typed by their own dataclass (model is built by its name: model_config).
SECTIONS: dict[str, type] = {
    "sync": SyncConfig, "data": DataConfig, "inner": InnerConfig, "outer": OuterSection, "quorum": QuorumConfig, "guard": GuardConfig, "robust": RobustConfig,
    "security": SecurityConfig, "init": InitConfig, "logging": LoggingConfig, "tensorboard": TensorBoardConfig, "parallel": ParallelConfig,
}  # fmt: skip


def run_config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain, JSON-able data that run_config_from_dict turns back into ``cfg`` (enums as strings)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
