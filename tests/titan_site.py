"""A torchtitan training job as a DiLoCo site, run by the tests under torchrun::

    torchrun --nproc-per-node=2 tests/titan_site.py --mode loop --dp-shard 2 --coordinator HOST:PORT \
        --site-id a --out result.json

``--mode loop`` (CPU, gloo; or ``--device cuda``): a loop of ours around torchtitan's own parts:
its llama3 ``debugmodel`` config (``--layers`` of its 6 blocks), built on the meta device and
parallelised by its own ``parallelize_llama`` (FSDP2 ``--dp-shard``, tensor parallel ``--tp``,
``ParallelDims`` meshes), initialised by ``init_states``, trained with its own cross-entropy loss
under its SPMD context on random tokens, through ``DiLoCo(...)``. On a CPU three things are
changed, each where torchtitan 0.3.0 stops there (docs/torchtitan.md): the meshes are built on
``cpu`` (torchtitan builds them on ``cuda`` when no accelerator is found); FSDP2 reduces with
SUM (torchtitan's gradient divide factor 1 makes it ask for ``PREMUL_SUM``, which gloo lacks);
and attention is torchtitan's ``ScaledDotProductAttention`` (causal: one document per sequence)
where its llama3 uses FlexAttention, which has no backward on a CPU.

``--mode trainer`` (a GPU): torchtitan's ``Trainer`` itself, as ``diloco.plugins.torchtitan.
DiLoCoTrainer``, with the llama3 ``debugmodel`` (flex attention, its masks built by the
trainer) on random tokens (``RandomTokens``: the c4_test data and tokenizer of torchtitan's
configs are in its repository, not in its wheel, and nothing may be downloaded).

After every round each rank gathers the model's whole θ and hashes it; rank 0 writes those
hashes, the site's θ hash and what each rank pushed to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from user_ranks_site import whole_state

from diloco import DiLoCo, init_distributed
from diloco.outer import params_sha256

VOCAB = 2048  # the debugmodel's


def model_config(layers: int, attention: str) -> Any:
    """torchtitan's llama3 debugmodel config with its first ``layers`` blocks; ``attention``:
    ``flex`` (its own) or ``sdpa`` (its ScaledDotProductAttention, causal, in every block)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:layers]
    if attention == "sdpa":
        for block in config.layers:
            block.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def on_cpu() -> None:
    """torchtitan builds its meshes on ``tools.utils.device_type``, which is ``cuda`` when no
    accelerator is found: on a CPU they are built on ``cpu`` instead."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


def sum_reductions(model: torch.nn.Module) -> None:
    """FSDP2 reduce-scatters with SUM (torchtitan sets a gradient divide factor of 1, for which
    FSDP2 asks for ``ReduceOp.PREMUL_SUM``, which gloo does not have; SUM divided by 1 is the same)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


# ---- random tokens for torchtitan's Trainer (its configs' c4_test and tokenizer are not in the wheel) ----


class NoTokenizer(BaseTokenizer):
    """A tokenizer that is never used: the data are token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__()
        self.vocab = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("NoTokenizer: the data are token ids")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("NoTokenizer: the data are token ids")

    def get_vocab_size(self) -> int:
        return self.vocab


class RandomTokens(BaseDataLoader):
    """Batches of uniform random token ids, each data-parallel rank its own stream
    (``seed``, dp rank): ``({"input": x, "positions": 0..L-1}, labels)``, labels ``x`` shifted."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        vocab_size: int = VOCAB

    def __init__(self, config: Config, *, dp_rank: int, local_batch_size: int, seq_len: int, **kwargs: Any) -> None:
        self.config = config
        self.batch, self.seq_len = local_batch_size, seq_len
        self.generator = torch.Generator().manual_seed(1000 * config.seed + dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens = torch.randint(0, self.config.vocab_size, (self.batch, self.seq_len + 1), generator=self.generator)
            positions = torch.arange(self.seq_len).expand(self.batch, -1)
            yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.generator.set_state(state_dict["generator"])


# ---- the two modes ------------------------------------------------------------------------


def run_loop(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Our loop around torchtitan's model, parallelize_llama and loss (see the module docstring)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    parallelism = ParallelismConfig(data_parallel_shard_degree=args.dp_shard, tensor_parallel_degree=args.tp, spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=args.batch, seq_len=args.seq_len, mixed_precision_param="float32")
    dims = ParallelDims.from_config(parallelism, world)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    attention = "sdpa" if device.type == "cpu" else "flex"  # FlexAttention has no backward on a CPU
    config = model_config(args.layers, attention)
    config.update_from_config(config=Trainer.Config(parallelism=parallelism, training=training))  # as its Trainer does
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
        model, parallel_dims=dims, training=training, parallelism=parallelism, compile_config=CompileConfig(), ac_config=None, dump_folder=args.dump
    )
    if device.type == "cpu":
        sum_reductions(model)
    model.to_empty(device=device)
    torch.manual_seed(args.seed)  # every rank draws the same θ₀ (each keeps its share)
    with torch.no_grad():
        model.init_states(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batch = dims.get_optional_mesh("batch")
    dp, dps = (batch.get_local_rank(), batch.size()) if batch is not None else (0, 1)
    tp_mesh = dims.get_optional_mesh("tp")
    counts = tp_mesh is None or tp_mesh.get_local_rank() == 0  # the ranks of a tensor-parallel group share their batch
    data = iter(RandomTokens(RandomTokens.Config(seed=args.seed), dp_rank=dp, local_batch_size=args.batch, seq_len=args.seq_len))
    hashes, losses = {}, []
    distributed = dist.is_initialized()
    with DiLoCo(model, optimizer, coordinator=args.coordinator, site_id=args.site_id, sync_every=args.sync_every) as dl:
        hashes["start"] = params_sha256(whole_state(model, distributed))
        while not dl.finished:
            batch_in, labels = next(data)
            inputs, labels = batch_in["input"].to(device), labels.to(device)
            extra = {}
            if attention == "flex":  # the masks torchtitan's Trainer builds for its flex attention
                positions = batch_in["positions"].to(device)
                extra = {"positions": positions, "attention_masks": model.get_attention_masks(positions=positions)}
            global_tokens = torch.tensor(labels.numel() * dps, device=device)
            with context():
                loss, _ = loss_fn(model(inputs, **extra), labels, global_tokens)  # this rank's summed loss / the step's tokens
                loss.backward()
            mean = float(loss.detach()) * dps  # this rank's mean loss per token
            dl.record_loss(mean, tokens=labels.numel() if counts else 0)
            losses.append(mean)
            before = dl.round
            optimizer.step()
            optimizer.zero_grad()
            if dl.round != before:  # a round ended: the model holds the new global θ
                hashes[str(before)] = params_sha256(whole_state(model, distributed))
        site_hash = dl.global_sha256()
        ranks = dl.layout.gather_objects({"pushed": sum(h.box.numel for h in dl.layout.held().values()), "bytes_up": dl.sync.stats.bytes_up})
        rounds = dl.round
    placements = {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()}
    return {"round_sha256": hashes, "global_sha256": site_hash, "losses": losses, "rounds": rounds, "ranks": ranks, "rank": rank, "placements": placements}


def run_trainer(args: argparse.Namespace) -> dict[str, Any]:
    """torchtitan's Trainer as DiLoCoTrainer, the llama3 debugmodel on random tokens."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    from diloco.plugins.torchtitan import DiLoCoTrainer, site_config

    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[: args.layers]
    base = Trainer.Config(
        model_spec=spec,
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=default_adamw(lr=args.lr),
        training=TrainingConfig(local_batch_size=args.batch, seq_len=args.seq_len, steps=10_000, mixed_precision_param="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=args.dp_shard, tensor_parallel_degree=args.tp),
        tokenizer=NoTokenizer.Config(),
        dataloader=RandomTokens.Config(seed=args.seed),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
        dump_folder=args.dump,
    )
    base.debug.seed = args.seed
    config = site_config(base, coordinator=args.coordinator, site_id=args.site_id, sync_every=args.sync_every)
    hashes: dict[str, str] = {}

    class Recording(DiLoCoTrainer):  # the test's view: the whole θ after every round
        def train_step(self, data_iterator: Any) -> None:
            before = self.diloco_site.round if self.diloco_site is not None else None
            super().train_step(data_iterator)
            site = self.diloco_site
            if before is not None and site is not None and site.round != before:
                hashes[str(before)] = params_sha256(whole_state(self.model_parts[0], dist.is_initialized()))

    config = DiLoCoTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
    trainer = Recording(config)
    try:
        trainer.train()
        site = trainer.diloco_site
        assert site is not None
        result = {
            "round_sha256": hashes,
            "global_sha256": site.global_sha256(),
            "rounds": site.round,
            "steps": trainer.step,
            "ranks": site.layout.gather_objects({"pushed": sum(h.box.numel for h in site.layout.held().values()), "bytes_up": site.sync.stats.bytes_up}),
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "device": str(trainer.device),
        }
    finally:
        trainer.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("loop", "trainer"), default="loop")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dp-shard", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--site-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=2)
    p.add_argument("--dump", default="outputs")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    faulthandler.dump_traceback_later(240, exit=True)  # a rank waiting for ever says where, and ends
    t0 = time.perf_counter()
    if args.mode == "trainer":
        result = run_trainer(args)  # the trainer starts torch.distributed itself
    else:
        device = torch.device(args.device)
        if device.type == "cpu":
            on_cpu()
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ:  # under torchrun, even one rank: torchtitan's meshes need a process group
            init_distributed("gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl")
        result = run_loop(args, device)
    result["wall_s"] = time.perf_counter() - t0
    if result["rank"] == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
