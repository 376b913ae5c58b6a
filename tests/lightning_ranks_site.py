"""A Lightning ``Trainer`` made a DiLoCo site by ``DiLoCoLightningCallback``, on every rank of a
torchrun group (gloo, CPU) or alone for a one-process site. Run by
tests/e2e/test_plugins_ranks.py::

    torchrun --standalone --nproc-per-node=2 tests/lightning_ranks_site.py --strategy ddp \
        --coordinator HOST:PORT --site-id a --out a.json
    python tests/lightning_ranks_site.py --coordinator HOST:PORT --site-id b --seed 2 --out b.json

``--strategy``: ``ddp`` (Lightning's DDPStrategy, which wraps the module in
DistributedDataParallel), ``model_parallel`` (Lightning's ModelParallelStrategy: the module's
``configure_model`` shards it with FSDP2 ``fully_shard`` over the data-parallel mesh) or
``auto`` (one process). The model is the project's tiny transformer (``model.…`` in the
LightningModule), the data random token ids (a batch is ``(x, y)``: its tokens are x's
elements, ``BATCH x CONTEXT`` per micro-batch).

Rank 0 writes to ``--out``: the hash of the whole θ after every round (by the round that
ended) and at the end, every rank's final hash, every rank's losses per micro-batch, the
global step the Trainer stopped at and the round count.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from site_args import coordinator_address, site_parser

from diloco.model import build_model, lm_loss, model_config
from diloco.outer import params_sha256
from diloco.plugins.lightning import DiLoCoLightningCallback

CONTEXT = 16
BATCH = 4  # per rank
ACCUMULATE = 2
CFG = model_config("tiny", context=CONTEXT, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64)


class TinyLM(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.model = build_model(CFG, seed=seed)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: FSDP2 over the data-parallel ranks (else nothing)."""
        mesh = getattr(self, "device_mesh", None)
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = lm_loss(self.model(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def whole_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole θ (sharded parameters gathered: collective under FSDP2)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in module.named_parameters()}


class Probe(pl.Callback):
    """Placed after the DiLoCo callback: hashes θ whenever a round has ended (every rank)."""

    def __init__(self, diloco: DiLoCoLightningCallback) -> None:
        self.diloco = diloco
        self.round = 0
        self.hashes: dict[str, str] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        site = self.diloco.site
        if site is not None and site.round != self.round:
            self.hashes[str(self.round)] = params_sha256(whole_state(pl_module))
            self.round = site.round


def main() -> None:
    p = site_parser()
    p.add_argument("--strategy", default="auto", choices=["auto", "ddp", "model_parallel"])
    args = p.parse_args()
    faulthandler.dump_traceback_later(120, exit=True)  # a rank waiting for ever says where, and ends

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    strategy: object = args.strategy
    if args.strategy == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    ids = torch.randint(0, 256, (256, CONTEXT + 1), generator=torch.Generator().manual_seed(7))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=BATCH)
    callback = DiLoCoLightningCallback(coordinator=coordinator_address(args.coordinator, args.port_file), site_id=args.site_id, sync_every=args.sync_every)
    probe = Probe(callback)
    module = TinyLM(args.seed)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy=strategy,
        max_steps=100,  # the coordinator's last round stops it before
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(os.path.abspath(args.out)),
        callbacks=[callback, probe],
    )
    trainer.fit(module, loader)
    final = params_sha256(whole_state(module))
    distributed = dist.is_available() and dist.is_initialized()
    every = [None] * dist.get_world_size() if distributed else [(final, module.losses)]
    if distributed:
        dist.all_gather_object(every, (final, module.losses))
    if trainer.global_rank == 0:
        result = {
            "round_sha256": probe.hashes,
            "global_sha256": final,
            "rank_sha256": [h for h, _ in every],
            "rank_losses": [losses for _, losses in every],
            "global_step": trainer.global_step,
            "rounds": probe.round,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "params": sum(p.numel() for p in build_model(CFG, seed=0).parameters()),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    if distributed:
        # Lightning unwrapped its DDP at teardown: free it before the process group (a DDP freed
        # after destroy_process_group now and then hangs, seen with the Hugging Face Trainer).
        del trainer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
