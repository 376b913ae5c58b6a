"""A multi-rank site's outer sync, measured (issue 36): one user-loop site of 1, 2 and 4 ranks
(torchrun, gloo, this machine's CPU) whose model is sharded with FSDP2 ``fully_shard``,
against a real ``diloco-coordinator`` (init=file, one site, fp32 on the wire).

Two ways for a sharded site to sync:

* ``ranks``: ``DiLoCo(...)`` on every rank: each rank pushes and pulls only its own rows
  (its share), concurrently; the parts of its sync from ``OuterSync.stats.timings``;
* ``via_rank0``: what a site without per-rank sync does: every rank gathers the whole model
  (``full_tensor()``), rank 0 pushes it whole through a one-process ``DiLoCo`` and pulls θ
  whole, then broadcasts θ to every rank, which keeps its rows.

Per configuration: each rank's bytes pushed and pulled per round, the site's sum, and the
median over the measured rounds (the first is left out: connections, first pull) of the
sync's seconds on rank 0 (``end_round``: from the round's last step to the model holding the
new θ) and of each part on every rank (delta, encode, push, wait, pull, apply).

    .venv/bin/python scripts/bench_site_ranks.py --out docs/measurements/site_ranks.json

The model: an MLP of ``--layers`` square ``--width`` layers (default 8 x 1024: 8.4 M
parameters, 33.6 MB in fp32). The machine has 2 cores: a 4-rank site runs 4 processes on
them beside the coordinator, so its compute is slower than 4 real GPUs would make it; bytes
do not depend on that.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

PARTS = ("delta_s", "encode_s", "push_s", "wait_s", "pull_s", "apply_s")


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


# ---- one site (a torchrun rank, or the one process) ------------------------------------------
def site(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from diloco import DiLoCo, init_distributed

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        init_distributed("gloo")
    rank = dist.get_rank() if ranks > 1 else 0
    model = build(args.width, args.layers)
    if ranks > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ranks,))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    via0 = args.mode == "via_rank0" and ranks > 1
    shadow: nn.Module | None = None
    if via0:
        solo = dist.new_group([0])  # every rank makes it; rank 0's one-process site syncs through it
        shadow = build(args.width, args.layers) if rank == 0 else None
        dl = DiLoCo(shadow, None, coordinator=args.coordinator, site_id="s", process_group=solo) if rank == 0 else None
    else:
        dl = DiLoCo(model, None, coordinator=args.coordinator, site_id="s")
    if dl is not None:
        dl.join()
    if via0:
        _scatter(model, shadow, rank)  # θ₀ as pulled by rank 0
    g = torch.Generator().manual_seed(rank)
    sync_s: list[float] = []
    for _ in range(args.rounds):
        for _ in range(args.H):
            x = torch.randn(args.batch, args.width, generator=g)
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        t0 = time.perf_counter()
        if via0:
            from torch.distributed.tensor import DTensor

            full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
            if rank == 0:
                assert shadow is not None and dl is not None
                with torch.no_grad():
                    for n, p in shadow.named_parameters():
                        p.copy_(full[n])
                for _ in range(args.H):
                    dl.step_done(args.batch * ranks)
                dl.end_round()
            _scatter(model, shadow, rank)
        else:
            assert dl is not None
            for _ in range(args.H):
                dl.step_done(args.batch)
            dl.end_round()
        sync_s.append(time.perf_counter() - t0)
    stats = dl.sync.stats if dl is not None else None
    mine = {
        "rank": rank,
        "bytes_up": stats.bytes_up if stats else 0,
        "bytes_down": stats.bytes_down if stats else 0,
        "timings": stats.timings if stats else [],
        "sync_s": sync_s,
    }
    if ranks > 1:
        every: list[Any] = [None] * ranks
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if dl is not None:
        dl.leave()
    if rank == 0:
        Path(args.result).write_text(json.dumps(every))
    if ranks > 1:
        dist.destroy_process_group()


def _scatter(model: nn.Module, shadow: nn.Module | None, rank: int) -> None:
    """θ from rank 0's one-process site to every rank (broadcast whole), each keeping its rows."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from diloco.site.layouts.fsdp import dtensor_box

    held = dict(shadow.named_parameters()) if shadow is not None else {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            whole = held[n].detach().clone() if rank == 0 else torch.empty(p.shape)
            dist.broadcast(whole, src=0)
            if isinstance(p, DTensor):
                p.to_local().copy_(whole[dtensor_box(p).slices()])
            else:
                p.copy_(whole)


# ---- the driver -----------------------------------------------------------------------------
def measure(ranks: int, mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    d = work / f"{mode}_{ranks}"
    d.mkdir(parents=True, exist_ok=True)
    port_file = d / "port.json"
    port_file.unlink(missing_ok=True)
    bin_dir = Path(sys.executable).parent
    coord = [str(bin_dir / "diloco-coordinator"), "init=file", f"init.path={work / 'theta0.pt'}", "sites=1", f"rounds={args.rounds}"]
    coord += [f"sync.every={args.H}", "coordinator.port=0", f"coordinator.port_file={port_file}", f"hydra.run.dir={d / 'coord'}"]
    procs = [subprocess.Popen(coord, stdout=open(d / "coord.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)]
    try:
        while not port_file.exists():
            if procs[0].poll() is not None:
                raise SystemExit((d / "coord.log").read_text())
            time.sleep(0.1)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
        me = [__file__, "--site", "--mode", mode, "--coordinator", address, "--result", str(d / "result.json")]
        me += ["--width", str(args.width), "--layers", str(args.layers), "--rounds", str(args.rounds), "--H", str(args.H), "--batch", str(args.batch)]
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable]
        procs.append(subprocess.Popen([*launch, *me], stdout=open(d / "site.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True))
        for p in procs[::-1]:
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"{mode} {ranks}: exit {p.returncode}\n" + (d / "site.log").read_text()[-4000:])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    every = json.loads((d / "result.json").read_text())
    final = json.loads((d / "coord" / "global.json").read_text())
    measured = slice(1, None)
    out: dict[str, Any] = {"ranks": ranks, "mode": mode, "rounds": args.rounds, "params": final["params"]}
    out["bytes_up_per_round"] = [r["bytes_up"] / args.rounds for r in every]
    out["bytes_down_per_round"] = [r["bytes_down"] / (args.rounds + 1) for r in every]  # θ at join is one update's size
    out["site_bytes_up_per_round"] = sum(out["bytes_up_per_round"])
    out["sync_s_rank0"] = statistics.median(every[0]["sync_s"][measured])
    out["parts_s"] = [{k: statistics.median(t[k] for t in r["timings"][measured]) for k in PARTS} if r["timings"] else None for r in every]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ranks")
    p.add_argument("--coordinator", default="")
    p.add_argument("--result", default="")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--work", type=Path, default=Path("runs/bench_site_ranks"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.site:
        site(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    torch.save({n: t.detach() for n, t in build(args.width, args.layers).named_parameters()}, args.work / "theta0.pt")
    results = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for mode in ("ranks", "via_rank0") if ranks > 1 else ("ranks",):
            r = measure(ranks, mode, args, args.work)
            results.append(r)
            up = ", ".join(f"{b / 1e6:.2f}" for b in r["bytes_up_per_round"])
            print(
                f"{mode:>9} x{ranks}: sync {r['sync_s_rank0']:.3f} s on rank 0; MB up per round per rank [{up}] = {r['site_bytes_up_per_round'] / 1e6:.2f}",
                flush=True,
            )
            for i, parts in enumerate(r["parts_s"]):
                if parts:
                    print(f"             rank {i}: " + "  ".join(f"{k[:-2]} {v:.3f}" for k, v in parts.items()), flush=True)
    doc = {"command": " ".join(sys.argv), "machine": "2 cores, CPU, gloo", "width": args.width, "layers": args.layers, "H": args.H, "results": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
