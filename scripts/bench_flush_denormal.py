"""What subnormal floats cost an inner step on the CPU, and what ``inner.flush_denormal`` buys.

One worker trains ``model=small`` (batch 4, the shipped corpus) for ``--steps`` inner steps,
once with subnormals kept and once flushed to zero, in one sitting, each in a fresh process
(the setting is per thread, and torch's worker threads take it when they start, so it is set
first, as diloco's processes do); every ``--every`` steps it prints the mean step time of the
window and how many subnormal values the parameters and the optimizer state hold (the slow
ones are intermediates: the softmax of bytes the model rules out, so the count there stays 0).

    .venv/bin/python scripts/bench_flush_denormal.py --steps 1500
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from diloco.data import DataConfig, ShardSampler, load_corpus
from diloco.model import build_model, model_config
from diloco.site.device import flush_denormals
from diloco.site.inner import InnerConfig, InnerTrainer

TINY = 1.1754944e-38  # the smallest normal float32


def subnormals(trainer: InnerTrainer) -> int:
    tensors = [p.detach() for p in trainer.model.parameters()]
    tensors += [t for st in trainer.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(int(((t.abs() > 0) & (t.abs() < TINY)).sum()) for t in tensors)


def run(flush: bool, args: argparse.Namespace) -> list[float]:
    """In this process, which has done nothing else yet: the seconds per step of each window."""
    torch.set_num_threads(args.threads)
    flush_denormals(flush)
    mcfg = model_config(args.model)
    corpus = load_corpus(DataConfig(), mcfg.context, num_shards=4)
    sampler = ShardSampler(corpus.train, shard=0, num_shards=4, batch_size=args.batch_size, context=mcfg.context, seed=0)
    trainer = InnerTrainer(build_model(mcfg, 0), InnerConfig(), total_steps=args.steps)
    windows, t = [], time.perf_counter()
    for i in range(1, args.steps + 1):
        trainer.step(*sampler.next_batch())
        if i % args.every == 0:
            windows.append((time.perf_counter() - t) / args.every)
            print(
                f"flush_denormal={flush}  steps {i - args.every + 1:5d}-{i:5d}: {windows[-1]:.4f} s/step  subnormal values held: {subnormals(trainer)}",
                file=sys.stderr,
                flush=True,
            )
            t = time.perf_counter()
    return windows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", choices=["kept", "flushed"], help=argparse.SUPPRESS)  # a child process: one mode, its windows as JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(args.one == "flushed", args)))
        return 0
    common = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "one"]
    kept, flushed = (
        json.loads(subprocess.run([sys.executable, __file__, *common, f"--one={mode}"], check=True, stdout=subprocess.PIPE, text=True).stdout)
        for mode in ("kept", "flushed")
    )
    last = max(1, len(kept) // 3)  # the last third of the run, where the model is confident
    a, b = statistics.median(kept[-last:]), statistics.median(flushed[-last:])
    print(f"first window: kept {kept[0]:.4f}, flushed {flushed[0]:.4f} s/step; last third (median): kept {a:.4f}, flushed {b:.4f} s/step: x{a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
