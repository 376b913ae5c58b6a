"""Synchronous data parallel (mode=ddp) and one worker (mode=single).

ddp: world_size processes, DDP with a gloo all-reduce of the gradients every step; each rank
reads its own shard, so a step sees world_size × batch_size sequences (like Horovod).
single: one process, no process group. Both run rounds × sync_every steps and write
metrics.jsonl with one line per block of sync_every steps, like a DiLoCo round.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco.app import records
from diloco.app.config import RunConfig
from diloco.app.records import GlobalRecord, MetricsLine, WorkerRecord, append_metrics
from diloco.data import ShardSampler, eval_batches, load_corpus
from diloco.io import peak_rss_mb
from diloco.model import build_model, count_params
from diloco.observe.tensorboard import RunBoard
from diloco.outer import params_sha256
from diloco.run_dir import RunDir
from diloco.site.inner import InnerTrainer, evaluate_loss


def run_data_parallel(
    cfg: RunConfig, *, rank: int, world_size: int, init_file: Path | None, run_dir: Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    distributed = world_size > 1
    if distributed:
        if init_file is None:
            raise ValueError("mode=ddp with more than one rank needs an init file for the process group")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        return _train(cfg, rank, world_size, run_dir, log)
    finally:
        if distributed:
            dist.destroy_process_group()


def _train(cfg: RunConfig, rank: int, world_size: int, run_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    distributed = world_size > 1
    corpus = load_corpus(cfg.data, cfg.model.context, num_shards=world_size)
    sampler = ShardSampler(corpus.train, shard=rank, num_shards=world_size, batch_size=cfg.data.batch_size, context=cfg.model.context, seed=cfg.seed)
    model = build_model(cfg.model, cfg.seed)
    params = count_params(model)
    wrapped = DistributedDataParallel(model) if distributed else model
    trainer = InnerTrainer(wrapped, cfg.inner, total_steps=cfg.total_steps)
    batches = eval_batches(corpus.heldout, context=cfg.model.context, batch_size=cfg.data.batch_size, num_batches=cfg.data.eval_batches) if rank == 0 else []
    # What an fp32 gradient all-reduce moves per step, counted like DiLoCo's push and pull:
    # every rank sends its whole gradient up and receives the whole mean down.
    # One worker (mode=single) communicates nothing.
    grad_bytes_per_step = 4 * params * world_size if distributed else 0
    # The run's TensorBoard scalars, as a DiLoCo coordinator writes them (tb/coordinator: the
    # same tags, so that runs of every mode compare in one TensorBoard).
    board = RunBoard(RunDir(run_dir).tensorboard("coordinator")) if rank == 0 and cfg.tensorboard.enabled else None
    start = time.monotonic()
    round_start = start
    final_eval: float | None = None
    final_loss: float | None = None
    to_bpb = 1 / math.log(2) if cfg.data.format == "bytes" else None  # bits per byte only where tokens are bytes
    for r in range(cfg.rounds):
        losses = [trainer.step(*sampler.next_batch()) for _ in range(cfg.schedule.steps_of(r))]  # DiLoCo's blocks (sync.schedule)
        loss = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
        if distributed:
            dist.all_reduce(loss)
            loss /= world_size
        if rank == 0:
            last = r + 1 == cfg.rounds
            eval_loss = evaluate_loss(model, batches)[0] if last or (r + 1) % cfg.eval_every == 0 else None
            eval_bpb = eval_loss * to_bpb if eval_loss is not None and to_bpb is not None else None
            final_eval = eval_bpb if last else final_eval
            final_loss = eval_loss if last else final_loss
            now = time.monotonic()
            line = _metrics_line(cfg, r, world_size, sampler.tokens_per_batch, grad_bytes_per_step, float(loss), eval_bpb, model)
            line.update(eval_loss=eval_loss, eval_by="coordinator" if eval_loss is not None else None)
            written = MetricsLine(**line, wall_s=round(now - round_start, 4), elapsed_s=round(now - start, 4))
            append_metrics(RunDir(run_dir).metrics, written)
            if board is not None:
                board.write(written)
            round_start = now
            log(f"{cfg.mode} round {r} done: train_loss={float(loss):.4f}" + (f" eval_bpb={eval_bpb:.4f}" if eval_bpb is not None else ""))
    if board is not None:
        board.close()
    digest = params_sha256(dict(model.named_parameters()))
    result = WorkerRecord(
        site_id=str(rank),
        shard=rank,
        rounds=cfg.rounds,
        tokens=cfg.total_steps * sampler.tokens_per_batch,
        inner_steps=trainer.steps_done,
        bytes_up=grad_bytes_per_step // world_size * cfg.total_steps,
        bytes_down=grad_bytes_per_step // world_size * cfg.total_steps,
        global_sha256=digest,
        wall_s=round(time.monotonic() - start, 3),
        peak_rss_mb=peak_rss_mb(),
    )
    records.write(RunDir(run_dir).worker(rank), result)
    if rank == 0:
        records.write(
            RunDir(run_dir).global_record,
            GlobalRecord(
                params=params,
                rounds_committed=cfg.rounds,
                global_sha256=digest,
                final_eval_bpb=final_eval,
                final_eval_loss=final_loss,
                wall_s=result.wall_s,
                peak_rss_mb=peak_rss_mb(),
            ),
        )
    return records.to_dict(result)


def _metrics_line(
    cfg: RunConfig, r: int, world_size: int, tokens_per_batch: int, grad_bytes_per_step: int, loss: float, eval_bpb: float | None, model: torch.nn.Module
) -> dict[str, Any]:
    """One block of sync_every steps (a DiLoCo round's), in the same format as a DiLoCo round."""
    steps = cfg.schedule.steps_of(r)
    return {
        "round": r,
        "participants": [str(i) for i in range(world_size)],
        "tokens": steps * tokens_per_batch * world_size,
        "inner_steps": steps * world_size,
        "bytes_up": grad_bytes_per_step * steps,
        "bytes_down": grad_bytes_per_step * steps,
        "train_loss": loss,
        "eval_bpb": eval_bpb,
        "update_norm": None,  # no outer update in the baselines
        "delta_norm": None,
        "global_sha256": params_sha256(dict(model.named_parameters())),
        # Nothing is ever absent, late or rejected in a synchronous run.
        "absent": [],
        "evicted": [],
        "late": [],
        "merged": [],
        "rejected": False,
        "guard": None,
    }
