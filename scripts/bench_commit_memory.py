"""The coordinator's commit in process: its peak memory and its time, round by round.

Builds the coordinator's data plane (diloco.coordinator.shard.Shard) on a synthetic θ of P
float32 parameters (bench_coordinator's), and each round adds the pushes of ``--sites``
sites (one Δ encoded once with ``--codec-up``, int8 by default, pushed by every site with
its own token count and held as it came: the fused intake) and commits it, as the
coordinator does under its lock. Around each commit it reads the process's resident memory
(VmRSS) and its peak (VmHWM, reset before the commit through /proc/self/clear_refs), and
prints per round: the RSS before and after the commit and its peak, above the baseline (the
RSS after the imports and a first torch.optim step, plus what the benchmark itself holds: the
encoded Δ's payloads), in MiB and in bytes per parameter: the coordinator's θ, the round's
float64 sums, the momentum, the downlink residual and the encoded update, and whatever the
commit allocates; the commit's wall and CPU seconds (every thread's) and its parts.

    .venv/bin/python scripts/bench_commit_memory.py --params 20000000 --rounds 4
    .venv/bin/python scripts/bench_commit_memory.py --path generic   # the generic path only

``--path``: ``auto`` (the blockwise in-place commit where it applies, as the coordinator
runs) or ``generic`` (diloco.coordinator.commit_blocks switched off: the generic path).
Linux only (/proc). One process per path: RSS that one path freed is not handed back to the
kernel for the other to reuse cleanly, so compare paths in separate runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_coordinator import theta_shapes  # noqa: E402  (the same synthetic θ: 2048 x 2048 matrices, their norms, a tail)

MIB = 1 << 20


def _status_kb(keys: tuple[str, ...] = ("VmRSS", "VmHWM")) -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0])
    return out


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=20_000_000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--codec-up", default="int8")
    p.add_argument("--codec-down", default="int8")
    p.add_argument("--no-error-feedback", action="store_true", help="the downlink without error feedback")
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    p.add_argument("--path", choices=("auto", "generic"), default="auto")
    p.add_argument(
        "--shards", type=int, default=1, help="coordinator.shards: the data plane cut into this many ranges, a thread each (diloco.coordinator.shards)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the rounds' figures here")
    a = p.parse_args()

    import torch

    from diloco.codec import get_codec
    from diloco.coordinator.commit import Closing
    from diloco.coordinator.config import CoordinatorConfig
    from diloco.coordinator.round_state import RoundState
    from diloco.coordinator.shard import Shard
    from diloco.outer import OuterConfig
    from diloco.types import PushHeader
    from diloco.wire import encode_chunks
    from diloco.wire.held import HeldPush

    if a.threads:
        torch.set_num_threads(a.threads)
    # torch.optim's first step imports much of torch (tens of MiB): before the baseline, so
    # that the first round's figures are the commit's, not the imports'.
    warm = torch.zeros(4)
    opt = torch.optim.SGD([warm], lr=0.1, momentum=0.9, nesterov=True)
    warm.grad = torch.ones(4)
    opt.step()
    if a.path == "generic":
        try:
            from diloco.coordinator import commit_blocks
        except ImportError:  # a tree from before the blockwise commit: generic anyway
            pass
        else:
            commit_blocks.ENABLED = False
    shapes = theta_shapes(a.params)
    gc.collect()
    base_kb = _status_kb()["VmRSS"]

    g = torch.Generator().manual_seed(0)
    theta = {n: torch.randn(s, generator=g).mul_(0.02) for n, s in shapes.items()}
    delta = {n: torch.randn(s, generator=g).mul_(1e-3) for n, s in shapes.items()}
    chunks = list(encode_chunks(delta, codec=get_codec(a.codec_up)))
    del delta
    held_kb = sum(len(c.payload) for c in chunks) // 1024  # the benchmark's own: the encoded Δ

    cfg = CoordinatorConfig(
        total_rounds=a.rounds, codec_down=a.codec_down, error_feedback_down=not a.no_error_feedback, fragments=a.fragments, fragment_split="balanced"
    )
    if a.shards > 1:
        import dataclasses

        from diloco.coordinator.shards import ShardSet

        shard = ShardSet(OuterConfig(), dataclasses.replace(cfg, shards=a.shards))
    else:
        shard = Shard(OuterConfig(), cfg)
    shard.install(theta, "bench")
    del theta
    gc.collect()
    base_kb += held_kb
    rows = []
    print(
        f"{a.params} parameters, {a.sites} sites, {a.codec_up} up, {a.codec_down} down, path={a.path}, torch threads={torch.get_num_threads()}, shards={a.shards}"
    )
    print("round  rss_before  peak  rss_after (MiB above baseline; B/param)   commit_s  cpu_s  mean_s  step_s  encode_s  record_s  add_s")
    for r in range(a.rounds):
        names, fragment = shard.open(r)
        state = RoundState.open(r, time.monotonic(), names, fragment)
        specs = shard.round_specs(r)
        add_s = 0.0
        for s in range(a.sites):
            header = PushHeader(site_id=f"s{s}", round=r, tokens=1000 + 10 * s, train_loss=1.0, inner_steps=1)
            held = HeldPush(specs)
            for c in chunks:
                if c.name in specs:
                    held.add(c)
            held.finish()
            weight = state.take(header, time.monotonic(), None)
            ta = time.perf_counter()
            shard.add(held, float(weight))
            add_s += time.perf_counter() - ta
            del held
        gc.collect()
        before = _status_kb()["VmRSS"]
        _reset_peak()
        times: dict[str, float] = {}
        t0, c0 = time.perf_counter(), time.process_time()
        record, update = shard.commit(state, Closing(frozenset(), time.monotonic(), 0.0, False), times)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        kb = _status_kb()
        del update
        row = {
            "round": r,
            "rss_before_mib": (before - base_kb) / 1024,
            "peak_mib": (kb["VmHWM"] - base_kb) / 1024,
            "rss_after_mib": (kb["VmRSS"] - base_kb) / 1024,
            "commit_s": wall,
            "cpu_s": cpu,  # the process's CPU over the commit, every thread's (the hash's worker too)
            **{k: v for k, v in times.items() if k.endswith("_s")},
            "add_s": add_s,  # the sites' pushes added into the round's sums (the fused intake's add), all of them
            "rejected": record.rejected,
            "sha256": record.global_sha256[:16],
        }
        rows.append(row)
        per = 1024 * 1024 / a.params
        print(
            f"{r:5d}  {row['rss_before_mib']:8.0f} ({row['rss_before_mib'] * per:4.1f})  {row['peak_mib']:6.0f} ({row['peak_mib'] * per:4.1f})"
            f"  {row['rss_after_mib']:6.0f} ({row['rss_after_mib'] * per:4.1f})   {wall:7.3f}  {cpu:5.3f}  {times.get('mean_s', 0):6.3f}  {times.get('step_s', 0):6.3f}"
            f"  {times.get('encode_s', 0):7.3f}  {times.get('record_s', 0):7.3f}  {add_s:5.3f}  {row['sha256']}{'  rejected' if record.rejected else ''}"
        )
    if a.json is not None:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rounds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
