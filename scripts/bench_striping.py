"""Connection striping through an emulated link: one site's push and pull of a round over K
concurrent streams (each its own TCP connection) against one stream, on a link whose
bandwidth-delay product one stream may not fill.

    .venv/bin/python scripts/bench_striping.py --bandwidth-mbit 1000 --rtt-ms 100 --streams 1,2,4,8 --out runs/striping.json

A real coordinator (gRPC, 127.0.0.1:0) and one site's OuterSync in this process, the WAN
emulator (diloco/sim/wan.py) between them on a thread; each round pushes model=small's Δ
(fp32 by default) and pulls the update. Prints the median push, pull and whole-sync seconds of
several rounds per K, and the goodput (payload bytes / second) each way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.model import build_model, model_config
from diloco.outer import OuterConfig
from diloco.sim.links import LinkSpec
from diloco.sim.wan import WanEmulator
from diloco.site.outer_sync import OuterSync, SyncOptions
from diloco.transport import CoordinatorClient, serve


def one(k: int, args: argparse.Namespace) -> dict:
    model = build_model(model_config(args.model), seed=0)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    coordinator = Coordinator(theta0, OuterConfig(), CoordinatorConfig(total_rounds=args.rounds + 1, codec_down=args.codec))
    server, port = serve(coordinator, "127.0.0.1", 0)
    link = LinkSpec(up_mbit=args.bandwidth_mbit, down_mbit=args.bandwidth_mbit, rtt_ms=args.rtt_ms, window_kb=args.window_kb)
    wan = WanEmulator(("127.0.0.1", port), {"0": link})
    try:
        ports = wan.start()
        with CoordinatorClient(f"127.0.0.1:{ports['0']}", timeout_s=600, streams=k) as client:
            sync = OuterSync(model, client, "0", SyncOptions.of(codec=args.codec, streams=k))
            sync.join()
            for _ in range(args.rounds):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p), alpha=1e-3)
                sync.sync(tokens=1, train_loss=1.0, inner_steps=1)
            sync.close()
            t = sync.stats.timings[1:]  # the first round warms the connections up
            up = statistics.median(x["bytes_up"] for x in t)
            down = statistics.median(x["bytes_down"] for x in t)
            push, pull = statistics.median(x["push_s"] for x in t), statistics.median(x["pull_s"] for x in t)
            whole = statistics.median(sum(x[p] for p in ("delta_s", "encode_s", "push_s", "wait_s", "pull_s", "apply_s")) for x in t)
            return {
                "streams": k,
                "push_s": round(push, 3),
                "pull_s": round(pull, 3),
                "sync_s": round(whole, 3),
                "up_mbit_s": round(up * 8 / push / 1e6, 1),
                "down_mbit_s": round(down * 8 / pull / 1e6, 1),
                "bytes_up": up,
                "bytes_down": down,
            }
    finally:
        wan.stop()
        server.stop(grace=None).wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--bandwidth-mbit", type=float, default=1000.0)
    ap.add_argument("--rtt-ms", type=float, default=100.0)
    ap.add_argument("--window-kb", type=float, help="each TCP connection's window (LinkSpec.window_kb); default: no limit")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for k in (int(x) for x in args.streams.split(",")):
        r = one(k, args)
        rows.append(r)
        print(
            f"streams {k}: push {r['push_s']:.3f} s ({r['up_mbit_s']:.0f} Mbit/s)  pull {r['pull_s']:.3f} s ({r['down_mbit_s']:.0f} Mbit/s)  sync {r['sync_s']:.3f} s",
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
