"""Model FLOPs utilization (MFU) of the inner trainer, the memory a DiLoCo site costs, and
the outer sync's time split, on one device (CPU or one CUDA GPU).

MFU = 6 × params × tokens/s ÷ peak, where tokens/s = batch × context ÷ the median step time
of ``diloco.site.inner.InnerTrainer`` (AdamW, grad clipping, ``inner.bf16`` autocast for
``--dtype bf16``; each step ends by reading the loss, as a site does), and peak is measured
in the same run: the median rate of a square matrix product of the same dtype on the same
device (after warm-up; on the CPU with the same torch thread count as training). Batches are
random token ids over the model's vocabulary at its full context (no data loading).

    .venv/bin/python scripts/bench_mfu.py --model small --device cpu --dtype fp32 --steps 10
    python3 scripts/bench_mfu.py --model base --device cuda --dtype bf16 --memory --sync --out mfu.json

``--memory``: the peak memory of a DiLoCo site (model, AdamW, and the outer sync's copies,
through one real outer round against a coordinator this process serves on 127.0.0.1) next
to a plain training loop of the same model, optimizer and batch; each runs in a fresh child
process (GPU: torch.cuda.max_memory_allocated/reserved; host: peak RSS).
``--sync``: the outer sync's time split (OuterSync.stats.timings: delta_s, encode_s, push_s,
wait_s, pull_s, apply_s) with the model on the device, median over ``--sync-rounds`` rounds
of one site against an in-process coordinator (its work shares this process).
``--no-mfu`` skips the MFU measurement (for --memory/--sync alone).

Prints a table and writes everything to ``--out`` (JSON, rewritten after each section, so a
run cut short keeps what it finished). Exit code 1 if any section failed (its error is in
the JSON under ``errors``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import diloco  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:  # a bare checkout: the package is the folder next to scripts/
    sys.path.insert(0, str(ROOT))

from diloco.model import MODEL_SIZES, build_model, count_params, model_config  # noqa: E402
from diloco.site.inner import InnerConfig, InnerTrainer  # noqa: E402

MiB = 1 << 20
SYNC_PARTS = ("delta_s", "encode_s", "push_s", "wait_s", "pull_s", "apply_s")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- small helpers -------------------------------------------------------------------------


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _rss_mb() -> float:
    """This process's resident memory now (MiB)."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB, 1)
    except OSError:
        return float("nan")


def _peak_rss_mb() -> float:
    """This process's peak resident memory (MiB): VmHWM, which starts afresh at exec (the
    rusage ru_maxrss of a child started from a big parent keeps the parent's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# ---- model, batches, trainer ---------------------------------------------------------------


def _model_cfg(name: str) -> Any:
    if name not in MODEL_SIZES:
        raise SystemExit(f"--model {name}: diloco.model has no such size; known: {', '.join(MODEL_SIZES)}")
    return model_config(name)


def _describe_model(cfg: Any, params: int) -> dict[str, Any]:
    keys = ("name", "vocab_size", "context", "d_model", "n_layers", "n_heads", "mlp_hidden", "tie_embeddings")
    d = {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}
    d["params"] = params
    return d


def _resolve_device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _setup_backends(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32


def _build(args: argparse.Namespace, device: torch.device) -> tuple[Any, torch.nn.Module, int]:
    cfg = _model_cfg(args.model)
    model = build_model(cfg, 0).to(device)
    return cfg, model, count_params(model)


def _compile(model: torch.nn.Module) -> None:
    """In place (nn.Module.compile): parameter names stay as they are, as OuterSync needs."""
    model.compile()


def _batches(cfg: Any, batch: int, device: torch.device, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(1234)
    out = []
    for _ in range(n):
        seq = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=g)
        seq = seq.to(device)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _inner_cfg(args: argparse.Namespace) -> InnerConfig:
    return InnerConfig(bf16=args.dtype == "bf16")


def _probe_matmul_dtype(trainer: InnerTrainer, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[str | None, float]:
    """One trainer step with a hook on the model's first Linear: the dtype its matmul ran in
    (bfloat16 where autocast is active on the model's device). Returns it and the loss."""
    seen: list[torch.dtype] = []
    linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    handle = linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype)) if linear is not None else None
    try:
        loss = trainer.step(x, y)
    finally:
        if handle is not None:
            handle.remove()
    return (str(seen[0]).replace("torch.", "") if seen else None), loss


# ---- peak: a matrix product of the same dtype on the same device ---------------------------


def measure_peak(device: torch.device, dtype: torch.dtype, size: int, reps: int, warmup: int) -> dict[str, Any]:
    sync = _sync_fn(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    c = torch.empty(size, size, device=device, dtype=dtype)
    # On a GPU one product of a large size takes about a millisecond: time several back to
    # back per sample, so the timer's own cost is small against it.
    inner = 10 if device.type == "cuda" else 1
    for _ in range(warmup):
        torch.matmul(a, b, out=c)
    sync()
    samples = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b, out=c)
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    flops = 2.0 * size**3
    rates = sorted(flops / s / 1e12 for s in samples)
    med = statistics.median(samples)
    del a, b, c
    return {
        "size": size, "dtype": str(dtype).replace("torch.", ""), "reps": reps, "warmup": warmup, "products_per_sample": inner,
        "median_s": round(med, 6), "tflops": round(flops / med / 1e12, 3), "tflops_min": round(rates[0], 3), "tflops_max": round(rates[-1], 3),
    }  # fmt: skip


# ---- the MFU measurement -------------------------------------------------------------------


def measure_mfu(args: argparse.Namespace, device: torch.device, result: dict[str, Any], save: Callable[[], None]) -> dict[str, Any]:
    sync = _sync_fn(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cfg, model, params = _build(args, device)
    trainer = InnerTrainer(model, _inner_cfg(args), total_steps=1_000_000)
    batches = _batches(cfg, args.batch, device)
    tokens_per_step = args.batch * cfg.context

    # The first step, eager: which dtype the matmuls really ran in.
    sync()
    t0 = time.perf_counter()
    matmul_dtype, first_loss = _probe_matmul_dtype(trainer, model, *batches[0])
    sync()
    eager_first_s = time.perf_counter() - t0
    out: dict[str, Any] = {"matmul_dtype_seen": matmul_dtype, "eager_first_step_s": round(eager_first_s, 4)}
    if args.dtype == "bf16" and matmul_dtype != "bfloat16":
        result["warnings"].append(
            f"--dtype bf16, but the InnerTrainer ran the model's first Linear in {matmul_dtype} on {device.type}: "
            f"its autocast is not active on this device, so these figures are not bf16 training"
        )
    compile_s = None
    if args.compile:
        _compile(model)
        sync()
        t0 = time.perf_counter()
        trainer.step(*batches[1 % len(batches)])  # compiles forward and backward
        sync()
        compile_s = time.perf_counter() - t0
    for i in range(args.warmup):
        trainer.step(*batches[i % len(batches)])
    sync()
    times, losses = [], [first_loss]
    for i in range(args.steps):
        x, y = batches[i % len(batches)]
        sync()
        t0 = time.perf_counter()
        losses.append(trainer.step(x, y))
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens_per_s = tokens_per_step / med
    flops_per_token = 6 * params
    # A finer count for reference (PaLM, appendix B): + 12 × layers × context × d_model per
    # token for the attention scores and their use (not halved for the causal mask).
    n_layers, d_model = getattr(cfg, "n_layers", 0), getattr(cfg, "d_model", 0)
    flops_per_token_attn = flops_per_token + 12 * n_layers * cfg.context * d_model
    achieved = flops_per_token * tokens_per_s / 1e12
    out.update(
        {
            "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "context": cfg.context, "tokens_per_step": tokens_per_step,
            "compile_first_step_s": _r(compile_s), "median_step_s": round(med, 6), "mean_step_s": round(statistics.fmean(times), 6),
            "min_step_s": round(min(times), 6), "max_step_s": round(max(times), 6), "step_s": [round(t, 6) for t in times],
            "tokens_per_s": round(tokens_per_s, 1), "flops_per_token": flops_per_token, "achieved_tflops": round(achieved, 4),
            "flops_per_token_with_attention": flops_per_token_attn,
            "achieved_tflops_with_attention": round(flops_per_token_attn * tokens_per_s / 1e12, 4),
            "loss_first": round(first_loss, 4), "loss_last": round(losses[-1], 4),
            "fused_adamw": bool(trainer.optimizer.defaults.get("fused")),
            "params_device": str(next(model.parameters()).device),
        }
    )  # fmt: skip
    if device.type == "cuda":
        out["max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated(device) / MiB, 1)
        out["max_memory_reserved_mb"] = round(torch.cuda.max_memory_reserved(device) / MiB, 1)
    out["peak_rss_mb"] = _peak_rss_mb()
    result["mfu"] = out
    save()
    # The peak, with the training's tensors gone (on a GPU they would only crowd the allocator).
    del trainer, model, batches, x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    peak = measure_peak(device, DTYPES[args.dtype], args.peak_size, args.peak_reps, args.peak_warmup)
    result["peak"] = peak
    out["peak_tflops"] = peak["tflops"]
    out["mfu"] = round(achieved / peak["tflops"], 5)
    out["mfu_with_attention"] = round(out["achieved_tflops_with_attention"] / peak["tflops"], 5)
    return out


# ---- --sync: the outer sync's time split ---------------------------------------------------


@contextlib.contextmanager
def coordinator(cfg: Any, rounds: int) -> Iterator[tuple[Any, str]]:
    """A coordinator holding the model's θ₀ (seed 0, on the CPU), served on 127.0.0.1."""
    from diloco.coordinator import Coordinator, CoordinatorConfig
    from diloco.outer import OuterConfig
    from diloco.transport import serve

    theta = {n: p.detach() for n, p in build_model(cfg, 0).named_parameters()}
    coord = Coordinator(theta, OuterConfig(), CoordinatorConfig(total_rounds=rounds, min_sites=1))
    del theta
    server, port = serve(coord, "127.0.0.1", 0)
    try:
        yield coord, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(10)


def _outer_sync(model: torch.nn.Module, client: Any) -> Any:
    from diloco.site.exchange import Timeouts
    from diloco.site.outer_sync import OuterSync, SyncOptions

    # Bounded waits, so that a round that cannot close fails the section instead of hanging.
    return OuterSync(model, client, "0", SyncOptions.of(timeouts=Timeouts(wait_poll_s=5.0, round_timeout_s=300.0, reconnect_timeout_s=30.0)))


def _global_copy(sync: Any) -> dict[str, Any]:
    ts = list(sync.global_params.values())
    return {
        "devices": sorted({str(t.device) for t in ts}),
        "pinned": all(t.is_pinned() for t in ts) if ts and all(t.device.type == "cpu" for t in ts) else False,
        "mb": round(sum(t.numel() * t.element_size() for t in ts) / MiB, 1),
    }


def measure_sync(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from diloco.transport import CoordinatorClient

    sync_dev = _sync_fn(device)
    cfg, model, params = _build(args, device)
    if args.compile:
        _compile(model)
    trainer = InnerTrainer(model, _inner_cfg(args), total_steps=1_000_000)
    batches = _batches(cfg, args.batch, device)
    tokens = args.batch * cfg.context * args.sync_steps
    walls = []
    with coordinator(cfg, args.sync_rounds) as (coord, address), CoordinatorClient(address, timeout_s=300, connect_timeout_s=30) as client:
        sync = _outer_sync(model, client)
        try:
            t0 = time.perf_counter()
            sync.join()
            join_s = time.perf_counter() - t0
            for _ in range(args.sync_rounds):
                loss = 0.0
                for i in range(args.sync_steps):
                    loss = trainer.step(*batches[i % len(batches)])
                sync_dev()
                t0 = time.perf_counter()
                sync.sync(tokens=tokens, train_loss=loss, inner_steps=args.sync_steps)
                sync_dev()
                walls.append(time.perf_counter() - t0)
            copy = _global_copy(sync)
            same_hash = sync.global_sha256() == coord.global_sha256()
            # The model holds θ again, bit for bit, still on its device.
            named = dict(model.named_parameters())
            model_is_theta = all(torch.equal(named[n].detach().cpu(), t.cpu()) for n, t in sync.global_params.items())
            on_device = {str(p.device) for p in model.parameters()}
            sync.leave()
        finally:
            sync.close()
    timings = sync.stats.timings
    parts = {k: _r(_median([t[k] for t in timings if k in t]), 5) for k in SYNC_PARTS}
    payload = 4 * params  # fp32 uplink and downlink
    return {
        "rounds": args.sync_rounds, "inner_steps_per_round": args.sync_steps, "codec": "fp32", "join_s": round(join_s, 4),
        "median_s": parts, "median_sync_wall_s": _r(_median(walls), 5), "sync_wall_s": [round(w, 5) for w in walls],
        "per_round": timings, "payload_mb": round(payload / MiB, 1),
        "push_mb_per_s": _r(payload / MiB / parts["push_s"], 1) if parts.get("push_s") else None,
        "pull_mb_per_s": _r(payload / MiB / parts["pull_s"], 1) if parts.get("pull_s") else None,
        "bytes_up": sync.stats.bytes_up, "bytes_down": sync.stats.bytes_down, "hash_equals_coordinator": same_hash,
        "model_equals_theta": model_is_theta, "model_devices": sorted(on_device), "global_copy": copy,
    }  # fmt: skip


# ---- --memory: a site against a plain loop, each in a child process -------------------------


def _child_argv(args: argparse.Namespace, kind: str, address: str | None, result: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--device", args.device, "--dtype", args.dtype]
    argv += ["--batch", str(args.batch), "--memory-steps", str(args.memory_steps), "--_child", kind, "--_result", str(result)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.compile:
        argv.append("--compile")
    if args.tf32:
        argv.append("--tf32")
    if address:
        argv += ["--_address", address]
    return argv


def memory_child(args: argparse.Namespace) -> int:
    """Runs in a fresh process: a plain loop (kind plain) or a DiLoCo site (kind site) of
    2 × --memory-steps steps; writes its memory figures to --_result."""
    device = _resolve_device(args.device)
    _setup_backends(args)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()
        torch.zeros(1, device=device)  # the CUDA context, before the baseline
    out: dict[str, Any] = {"kind": args._child, "rss_baseline_mb": _rss_mb(), "marks": {}}

    def mark(name: str) -> None:
        m: dict[str, Any] = {"rss_mb": _rss_mb(), "peak_rss_mb": _peak_rss_mb()}
        if cuda:
            torch.cuda.synchronize(device)
            m["allocated_mb"] = round(torch.cuda.memory_allocated(device) / MiB, 1)
            m["peak_allocated_since_last_mb"] = round(torch.cuda.max_memory_allocated(device) / MiB, 1)
            out.setdefault("_peaks", []).append(torch.cuda.max_memory_allocated(device))
            out.setdefault("_peaks_reserved", []).append(torch.cuda.max_memory_reserved(device))
            torch.cuda.reset_peak_memory_stats(device)  # the next mark's peak is of its own phase
        out["marks"][name] = m

    cfg, model, params = _build(args, device)
    if args.compile:
        _compile(model)
    trainer = InnerTrainer(model, _inner_cfg(args), total_steps=1_000_000)
    batches = _batches(cfg, args.batch, device)
    out["params"] = params
    mark("model_built")

    def train(n: int) -> float:
        loss = 0.0
        for i in range(n):
            loss = trainer.step(*batches[i % len(batches)])
        return loss

    if args._child == "plain":
        train(args.memory_steps)
        mark("trained")
        train(args.memory_steps)
        mark("trained_again")
    else:
        from diloco.transport import CoordinatorClient

        with CoordinatorClient(args._address, timeout_s=300, connect_timeout_s=30) as client:
            sync = _outer_sync(model, client)
            try:
                sync.join()
                mark("joined")
                loss = train(args.memory_steps)
                mark("trained")
                sync.sync(tokens=args.batch * cfg.context * args.memory_steps, train_loss=loss, inner_steps=args.memory_steps)
                mark("synced")  # the peak of this phase: the outer sync's own
                out["global_copy"] = _global_copy(sync)
                train(args.memory_steps)  # training again, with the sync's copies held
                mark("trained_again")
                sync.leave()
            finally:
                sync.close()
    # Each mark reset the peaks: the run's are the largest of its phases'.
    peaks, peaks_reserved = out.pop("_peaks", []), out.pop("_peaks_reserved", [])
    if cuda:
        out["max_memory_allocated_mb"] = round(max(peaks) / MiB, 1) if peaks else None
        out["max_memory_reserved_mb"] = round(max(peaks_reserved) / MiB, 1) if peaks_reserved else None
    out["peak_rss_mb"] = _peak_rss_mb()
    _write_json(Path(args._result), out)
    return 0


def measure_memory(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg = _model_cfg(args.model)
    n = count_params(build_model(cfg, 0))
    out: dict[str, Any] = {
        "steps_per_phase": args.memory_steps,
        # What the plain loop holds besides activations: weights, gradients, AdamW's two moments.
        "expected_mb": {"weights": round(4 * n / MiB, 1), "grads": round(4 * n / MiB, 1), "adamw": round(8 * n / MiB, 1)},
    }
    with tempfile.TemporaryDirectory(prefix="bench_mfu_mem_") as tmp:
        with coordinator(cfg, 1) as (_coord, address):
            for kind in ("plain", "site"):
                path = Path(tmp) / f"{kind}.json"
                argv = _child_argv(args, kind, address if kind == "site" else None, path)
                proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=args.child_timeout_s)
                if proc.returncode != 0 or not path.exists():
                    raise RuntimeError(f"memory child '{kind}' exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                out[kind] = json.loads(path.read_text())
    plain, site = out["plain"], out["site"]
    diff: dict[str, Any] = {"peak_rss_mb": round(site["peak_rss_mb"] - plain["peak_rss_mb"], 1)}
    if device.type == "cuda":
        diff["max_memory_allocated_mb"] = round(site["max_memory_allocated_mb"] - plain["max_memory_allocated_mb"], 1)
        diff["max_memory_reserved_mb"] = round(site["max_memory_reserved_mb"] - plain["max_memory_reserved_mb"], 1)
        sync_phase = site["marks"]["synced"]
        diff["sync_phase_peak_over_trained_allocated_mb"] = round(sync_phase["peak_allocated_since_last_mb"] - site["marks"]["trained"]["allocated_mb"], 1)
    out["site_minus_plain"] = diff
    return out


# ---- report --------------------------------------------------------------------------------


def _fmt(x: Any, spec: str = ",.1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(res: dict[str, Any]) -> None:
    m = res.get("model", {})
    print(
        f"bench_mfu: model={res['args']['model']} params={_fmt(m.get('params'), ',d')} device={res['device']} ({res.get('device_name')}) "
        f"dtype={res['args']['dtype']} compile={res['args']['compile']} threads={res['threads']} torch={res['torch']}"
    )
    mfu = res.get("mfu")
    if mfu:
        print(
            f"  batch                {mfu['batch']} x {mfu['context']} = {mfu['tokens_per_step']:,} tokens/step   (matmul dtype seen: {mfu['matmul_dtype_seen']})"
        )
        print(
            f"  step time            median {mfu['median_step_s'] * 1e3:,.2f} ms  (min {mfu['min_step_s'] * 1e3:,.2f}, max {mfu['max_step_s'] * 1e3:,.2f}, {mfu['steps']} steps)"
        )
        if mfu.get("compile_first_step_s") is not None:
            print(f"  compile (1st step)   {mfu['compile_first_step_s']:,.1f} s")
        print(f"  tokens/s             {mfu['tokens_per_s']:,.0f}")
        print(f"  achieved             {mfu['achieved_tflops']:,.3f} TFLOP/s  (6 x params x tokens/s)")
        peak = res.get("peak")
        if peak:
            print(f"  peak                 {peak['tflops']:,.3f} TFLOP/s  ({peak['size']}^3 {peak['dtype']} matmul, median of {peak['reps']})")
            print(f"  MFU                  {100 * mfu['mfu']:.2f} %   (with attention FLOPs: {100 * mfu['mfu_with_attention']:.2f} %)")
        if "max_memory_allocated_mb" in mfu:
            print(f"  GPU memory           max allocated {mfu['max_memory_allocated_mb']:,.0f} MiB, reserved {mfu['max_memory_reserved_mb']:,.0f} MiB")
        print(f"  host peak RSS        {mfu['peak_rss_mb']:,.0f} MiB")
    mem = res.get("memory")
    if mem:
        cuda = "max_memory_allocated_mb" in mem["plain"]
        print("memory (peak, MiB)        plain loop      DiLoCo site     site - plain")
        rows = [("host RSS", "peak_rss_mb")] + ([("GPU allocated", "max_memory_allocated_mb"), ("GPU reserved", "max_memory_reserved_mb")] if cuda else [])
        for label, key in rows:
            print(f"  {label:<22}{_fmt(mem['plain'].get(key)):>12}{_fmt(mem['site'].get(key)):>16}{_fmt(mem['site_minus_plain'].get(key)):>16}")
        gc = mem["site"].get("global_copy", {})
        print(f"  site's copy of θ: {gc.get('mb')} MiB on {gc.get('devices')}, pinned={gc.get('pinned')}")
        if cuda:
            print(f"  GPU peak of the sync phase over allocated before it: {mem['site_minus_plain']['sync_phase_peak_over_trained_allocated_mb']} MiB")
    sync = res.get("sync")
    if sync:
        parts = "  ".join(f"{k[:-2]} {_fmt(v, '.4f')}" for k, v in sync["median_s"].items())
        print(f"sync (median of {sync['rounds']} rounds, s): {parts}   whole sync {_fmt(sync['median_sync_wall_s'], '.4f')}")
        print(
            f"  payload {sync['payload_mb']} MiB each way; push {_fmt(sync['push_mb_per_s'])} MiB/s, pull {_fmt(sync['pull_mb_per_s'])} MiB/s; "
            f"hash = coordinator's: {sync['hash_equals_coordinator']}; model = θ: {sync['model_equals_theta']} on {sync['model_devices']}; "
            f"θ copy on {sync['global_copy']['devices']} pinned={sync['global_copy']['pinned']}"
        )
    for w in res.get("warnings", []):
        print(f"WARNING: {w}")
    for k, e in res.get("errors", {}).items():
        print(f"ERROR in {k}: {e.strip().splitlines()[-1] if e.strip() else e}")


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help=f"a size of diloco.model ({', '.join(MODEL_SIZES)})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="bf16: the inner trainer's bf16 autocast (inner.bf16=true)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (in place, nn.Module.compile)")
    p.add_argument("--tf32", action="store_true", help="CUDA: allow TF32 matmuls (training and the peak)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 32 on cuda, 16 on cpu)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (after the first step and, with --compile, the compiling one)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n^3 peak matmul (default: 8192 on cuda, 2048 on cpu)")
    p.add_argument("--peak-reps", type=int, default=None, help="timed samples of the peak matmul (default: 10 on cuda, 5 on cpu)")
    p.add_argument("--peak-warmup", type=int, default=3)
    p.add_argument("--memory", action="store_true", help="peak memory of a DiLoCo site vs a plain training loop")
    p.add_argument("--memory-steps", type=int, default=3, help="--memory: inner steps per phase")
    p.add_argument("--sync", action="store_true", help="the outer sync's time split, model on the device")
    p.add_argument("--sync-rounds", type=int, default=4)
    p.add_argument("--sync-steps", type=int, default=2, help="--sync: inner steps per round")
    p.add_argument("--no-mfu", action="store_true", help="skip the MFU measurement")
    p.add_argument("--child-timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    p.add_argument("--_child", choices=("plain", "site"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--_address", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.batch = args.batch or (32 if cuda else 16)
    args.peak_size = args.peak_size or (8192 if cuda else 2048)
    args.peak_reps = args.peak_reps or (10 if cuda else 5)
    for name in ("batch", "steps", "peak_size", "peak_reps", "memory_steps", "sync_rounds", "sync_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.peak_warmup < 0:
        p.error("--warmup and --peak-warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._child:
        return memory_child(args)
    device = _resolve_device(args.device)
    _setup_backends(args)
    res: dict[str, Any] = {
        "bench": "mfu",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "tf32": args.tf32,
        "warnings": [],
        "errors": {},
    }

    def save() -> None:
        _write_json(args.out, res)

    cfg = _model_cfg(args.model)
    res["model"] = _describe_model(cfg, count_params(build_model(cfg, 0)))

    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if not args.no_mfu:
        sections.append(("mfu", lambda: measure_mfu(args, device, res, save)))
    if args.sync:
        sections.append(("sync", lambda: measure_sync(args, device)))
    if args.memory:
        sections.append(("memory", lambda: measure_memory(args, device)))
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception:
            res["errors"][name] = traceback.format_exc()
            print(f"bench_mfu: {name} failed:\n{res['errors'][name]}", file=sys.stderr, flush=True)
        res.setdefault("section_wall_s", {})[name] = round(time.perf_counter() - t0, 2)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    print_table(res)
    if args.out:
        print(f"results: {args.out}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
