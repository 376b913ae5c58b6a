"""Codec cost on real pseudo-gradients: bytes against fp32, encode and decode MB/s, and the
memcpy (torch clone) bandwidth of the same tensors measured in the same run as the ceiling.

The pseudo-gradient is that of the reference model after ``--steps`` inner AdamW steps on the
shipped corpus (Δ = θ_0 − θ_H, the thing a site sends), one tensor per parameter. Each codec
encodes it exactly as a push does (``encode_chunks``: per tensor, chunks of at most 1 MiB of
payload) and decodes every chunk with ``codec.decode``. Throughput is fp32 input bytes per
second (4 × params / time), the median of ``--repeats`` timed passes after one warm-up, on
``--threads`` torch threads (default 1: one core). ``vs memcpy`` divides by the clone
bandwidth; ``enc+dec`` is the bandwidth of an encode followed by a decode (1 / (1/enc + 1/dec)).

    .venv/bin/python scripts/bench_codecs.py                 # model=small, 50 steps, 1 thread
    .venv/bin/python scripts/bench_codecs.py --model tiny --steps 10 --repeats 3   # quick

``int8:torch`` is int8 on its torch path, without the compiled C loops (same bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from diloco.codec import make_codec
from diloco.data import DataConfig, ShardSampler, load_corpus
from diloco.model import build_model, model_config
from diloco.site.inner import InnerConfig, InnerTrainer
from diloco.wire import encode_chunks

DEFAULT_CODECS = "fp32,fp16,bf16,int8,int8:torch,int4,e3m0,topk2bit,fp32+zstd,int8+zstd,topk2bit+zstd"


def pseudo_gradient(model_name: str, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """Δ = θ_0 − θ_steps of the reference model trained on the shipped corpus."""
    mcfg = model_config(model_name)
    corpus = load_corpus(DataConfig(), mcfg.context)
    sampler = ShardSampler(corpus.train, shard=0, num_shards=1, batch_size=16, context=mcfg.context, seed=seed)
    model = build_model(mcfg, seed)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = InnerTrainer(model, InnerConfig(), total_steps=max(steps, 1))
    for _ in range(steps):
        trainer.step(*sampler.next_batch())
    return {n: theta0[n] - p.detach() for n, p in model.named_parameters()}


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_codecs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=50, help="inner steps before taking Δ (default 50)")
    p.add_argument("--codecs", default=DEFAULT_CODECS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    delta = pseudo_gradient(args.model, args.steps, args.seed)
    params = sum(t.numel() for t in delta.values())
    mb = 4 * params / 1e6
    memcpy = mb / timed(lambda: [t.clone() for t in delta.values()], args.repeats)
    flat = torch.cat([t.reshape(-1) for t in delta.values()])
    memcpy_flat = mb / timed(flat.clone, args.repeats)
    print(f"bench_codecs: model={args.model} params={params} ({mb:.1f} MB fp32) Δ after {args.steps} steps, threads={args.threads}, median of {args.repeats}")
    print(f"memcpy (torch clone) per tensor, as the codecs see them: {memcpy:.0f} MB/s (the ceiling below); of Δ as one flat tensor: {memcpy_flat:.0f} MB/s")
    print(f"{'codec':<15} {'bytes':>11} {'vs fp32':>8} {'bits/value':>10} {'enc MB/s':>9} {'dec MB/s':>9} {'enc+dec':>8} {'vs memcpy':>9} {'rel err':>8}")
    for name in [c.strip() for c in args.codecs.split(",") if c.strip()]:
        codec = make_codec(name.removesuffix(":torch"))
        if name.endswith(":torch"):
            codec.use_native = False
        chunks = list(encode_chunks(delta, codec=codec))
        size = sum(len(c.payload) for c in chunks)
        enc_s = timed(lambda: list(encode_chunks(delta, codec=codec)), args.repeats)  # noqa: B023 - timed at once
        dec_s = timed(lambda: [codec.decode(c.payload, c.numel) for c in chunks], args.repeats)  # noqa: B023 - timed at once
        decoded = {}
        for c in chunks:
            decoded.setdefault(c.name, []).append(codec.decode(c.payload, c.numel))
        err = sum(float((torch.cat(decoded[n]) - t.reshape(-1)).pow(2).sum()) for n, t in delta.items())
        rel = (err / sum(float(t.pow(2).sum()) for t in delta.values())) ** 0.5
        both = mb / (enc_s + dec_s)
        print(
            f"{name:<15} {size:>11} {4 * params / size:>7.1f}x {8 * size / params:>10.2f} {mb / enc_s:>9.0f} {mb / dec_s:>9.0f} "
            f"{both:>8.0f} {100 * both / memcpy:>8.1f}% {rel:>8.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
