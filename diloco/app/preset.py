"""``sync.preset=hide_link``: one word for "hide the link I have". diloco-plan's model
(diloco.plan) chooses the streaming settings that hide the run's link behind training, the way
docs/streaming.md's measurements found best, so that they need not be read to be had.

The link is ``sync.link_mbit`` / ``sync.link_rtt_ms`` when given, else diloco-sim's emulated
one (``wan.*``); the step time ``sync.step_s``, else measured here on the run's model (diloco-sim:
its sites share this machine's cores, so the time of one step is scaled by how many sites share
each core). Candidates: an int8 uplink; fragments F among the divisors of H up to the model's
layers and H/2, balanced, frozen at their last push; overlap τ below H/F with the look-ahead
merge (``ahead``); an int8 or int4 downlink. The choice is the first candidate, in order of
what it costs the model (τ, then F, then the 4-bit downlink: the more steps overlap, the more
the merge has to repair), whose predicted whole-run utilization reaches TARGET; none reaching
it, the best predicted. A run whose blocking sync already reaches TARGET keeps it. Keys the run
set by hand (differing from their defaults) stay as set. The resolved keys are the run's config
(config.json), and the choice is logged with its prediction.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.app.config import RunConfig
from diloco.codec import CodecConfig
from diloco.model import build_model
from diloco.outer.fragments import layer_of
from diloco.plan import NO_COORDINATOR_CPU, Plan, run_utilization
from diloco.sync import FragmentEnd, FragmentSplit, Merge, Preset, SyncConfig

# The planner with a 2% straggle was 1.4 to 2.3 points optimistic against every emulated run of
# equal fragments (docs/plan.md): 97% predicted is about 95% measured.
TARGET = 0.97
STRAGGLE = 0.02  # the slowest site's extra time between syncs, as a share of the steps (measured: docs/plan.md)
LINK_COST = 0.005  # a link that costs blocking DiLoCo less than half a point of utilization is left as it is
OVERHEAD_S = 0.3  # fixed seconds per sync: encode, commit, checkpoint, decode (0.306 s measured here: docs/measurements/streaming.md)
INT8 = CodecConfig(name="int8")
INT4 = CodecConfig(name="int4")


@dataclass(frozen=True)
class Choice:
    fragments: int
    overlap: int
    down: CodecConfig
    predicted: float  # whole-run utilization diloco-plan predicts for it
    blocking: float  # and for blocking DiLoCo with the run's codecs

    def describe(self) -> str:
        how = ("sync.split=balanced sync.end=freeze " if self.fragments > 1 else "") + ("sync.merge=ahead " if self.fragments > 1 or self.overlap else "")
        return (
            f"sync.fragments={self.fragments} sync.overlap={self.overlap} {how}codec=int8 codec_down={self.down.name}"
            f" (predicted utilization {self.predicted:.3f}; blocking {self.blocking:.3f})"
        )


def bits(codec: CodecConfig) -> float:
    """Payload bits per value of a codec (its scales included)."""
    built = codec.build()
    inner = getattr(built, "inner", built)
    per = {"fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "int8": 8.0, "int4": 4.0, "e3m0": 4.0, "topk2bit": 4.0}[codec.name]
    block = getattr(inner, "block", None)
    return per + (32.0 / block if block and codec.name in ("int8", "int4", "e3m0") else 0.0)


def choose(
    *,
    params: float,
    step_s: float,
    every: int,
    rounds: int,
    sites: int,
    layers: int,
    mbit: float,
    rtt_ms: float,
    up: CodecConfig,
    down: CodecConfig,
    fragments: int | None = None,
    overlap: int | None = None,
    keep_down: bool = False,
) -> Choice:
    """The preset's choice for a model of ``params`` parameters and ``layers`` layers;
    ``fragments``, ``overlap``, ``keep_down`` (``down``): fixed by the run (the search keeps them)."""

    def predicted(fragments: int, overlap: int, up_bits: float, down_bits: float, gbit: float = mbit / 1000, rtt: float = rtt_ms) -> float:
        plan = Plan(
            params=params, step_s=step_s, sync_every=every, bits=up_bits, down_bits=down_bits, fragments=fragments, overlap_steps=overlap, sites=sites,
            bandwidth_gbit=gbit, coordinator_bandwidth_gbit=1e6, rtt_ms=rtt, overhead_s=OVERHEAD_S, straggle=STRAGGLE,
            **NO_COORDINATOR_CPU,  # OVERHEAD_S is the coordinator's measured cost already
        )  # fmt: skip
        return run_utilization(plan, rounds, flush=False)

    blocking = predicted(1, 0, bits(up), bits(down))
    # What the link itself costs blocking DiLoCo (against an infinitely fast one): under
    # LINK_COST there is nothing of the link to hide, whatever the overhead and straggle cost.
    link_cost = predicted(1, 0, bits(up), bits(down), gbit=1e9, rtt=0.0) - blocking
    if (blocking >= TARGET or link_cost < LINK_COST) and fragments in (None, 1) and overlap in (None, 0):
        return Choice(1, 0, down, blocking, blocking)
    candidates = []
    for f in [f for f in range(1, min(max(layers, 1), every // 2) + 1) if every % f == 0] if fragments is None else [fragments]:
        for tau in range(every // f) if overlap is None else [overlap]:
            for d in (INT8, INT4) if not keep_down else (down,):
                candidates.append((tau, f, d.name == "int4", predicted(f, tau, bits(up), bits(d)), d))
    candidates.sort(key=lambda c: c[:3])
    good = [c for c in candidates if c[3] >= TARGET]
    tau, f, _, util, d = good[0] if good else max(candidates, key=lambda c: c[3])
    return Choice(f, tau, d, util, blocking)


def measure_step_s(cfg: RunConfig, steps: int = 4) -> float:
    """Seconds of one inner step of the run's model and batch on this machine (one process, the
    run's threads), after a warm-up step."""
    from diloco.site.inner import InnerTrainer  # the site's own trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        model = build_model(cfg.model, cfg.seed)
        trainer = InnerTrainer(model, cfg.inner, total_steps=steps + 1)
        x = torch.randint(0, min(cfg.model.vocab_size, 256), (cfg.data.batch_size, cfg.model.context))
        trainer.step(x, x)
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step(x, x)
        return (time.perf_counter() - t0) / steps
    finally:
        torch.set_num_threads(threads)


def apply_preset(
    cfg: RunConfig, *, link: tuple[float, float] | None = None, shared_cores: bool = False, measure: bool = True, log: Callable[[str], None] = print
) -> RunConfig:
    """``cfg`` with its sync keys and codecs chosen by ``sync.preset`` (unchanged without one).
    ``link``: (Mbit/s, RTT ms) of diloco-sim's emulated link, where the run states none;
    ``shared_cores``: the sites share this machine (diloco-sim), so a measured step is scaled by
    the sites per core; ``measure``: the step time may be measured here (not on a coordinator's
    host, which does not train). ValueError naming what is missing."""
    sync = cfg.sync
    if sync.preset == Preset.NONE or cfg.mode != "diloco":
        return cfg
    mbit = sync.link_mbit if sync.link_mbit is not None else (link[0] if link else None)
    rtt = sync.link_rtt_ms if sync.link_rtt_ms is not None else (link[1] if link else None)
    if mbit is None or rtt is None:
        raise ValueError("sync.preset=hide_link needs the link: sync.link_mbit and sync.link_rtt_ms (diloco-sim: or wan.bandwidth_mbit and wan.rtt_ms)")
    step_s = sync.step_s
    if step_s is None and not measure:
        raise ValueError("sync.preset=hide_link needs sync.step_s here (seconds of one inner step at a site): this host does not train")
    if step_s is None:
        ranks = sum(cfg.layout_of(s).ranks or 1 for s in range(cfg.sites))
        step_s = measure_step_s(cfg) * (max(1.0, ranks * cfg.threads / (os.cpu_count() or 1)) if shared_cores else 1.0)
    model = build_model(cfg.model, cfg.seed)
    names = [n for n, _ in model.named_parameters()]
    layers = len({i for i in (layer_of(n) for n in names) if i is not None})
    params = float(sum(p.numel() for p in model.parameters()))
    up = cfg.codec if cfg.codec.name != "fp32" else INT8
    plain = SyncConfig()
    choice = choose(
        params=params, step_s=step_s, every=sync.every, rounds=cfg.rounds, sites=cfg.sites, layers=layers or len(names), mbit=mbit, rtt_ms=rtt, up=up,
        down=cfg.downlink_codec if cfg.codec_down is not None else up, fragments=sync.fragments if sync.fragments != plain.fragments else None,
        overlap=sync.overlap if sync.overlap != plain.overlap else None, keep_down=cfg.codec_down is not None,
    )  # fmt: skip
    chosen = _resolved(cfg, choice, mbit, rtt, step_s)
    log(f"sync.preset=hide_link for {mbit:g} Mbit/s, {rtt:g} ms and a {step_s:.3f} s step: {choice.describe()}")
    return chosen


def _resolved(cfg: RunConfig, choice: Choice, mbit: float, rtt: float, step_s: float) -> RunConfig:
    """The run with the choice in its keys; keys set by hand (not their default) stay."""
    sync, plain = cfg.sync, SyncConfig()

    def pick(name: str, value: object) -> object:
        return getattr(sync, name) if getattr(sync, name) != getattr(plain, name) else value

    streaming = choice.fragments > 1 or choice.overlap > 0
    new_sync = {
        "fragments": pick("fragments", choice.fragments),
        "overlap": pick("overlap", choice.overlap),
        "split": pick("split", FragmentSplit.BALANCED if choice.fragments > 1 else sync.split),
        "end": pick("end", FragmentEnd.FREEZE if choice.fragments > 1 else sync.end),
        "merge": pick("merge", Merge.AHEAD if streaming else sync.merge),
        "link_mbit": mbit,
        "link_rtt_ms": rtt,
        "step_s": round(step_s, 4),
    }
    fields = {f.name: getattr(sync, f.name) for f in dataclasses.fields(SyncConfig)}
    if sync.local_weight == (0.5 if sync.overlap > 0 else 0.0):
        fields["local_weight"] = None  # the default: it follows the chosen overlap
    chosen = SyncConfig(**{**fields, **new_sync})
    codec = cfg.codec if cfg.codec.name != "fp32" else INT8
    codec_down = cfg.codec_down if cfg.codec_down is not None else choice.down
    return dataclasses.replace(cfg, sync=chosen, codec=codec, codec_down=codec_down)
