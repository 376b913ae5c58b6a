"""A Hugging Face ``Trainer`` made a DiLoCo site by ``DiLoCoCallback``, on every rank of a
torchrun group (the Trainer wraps the model in DDP itself; gloo, CPU) or alone for a
one-process site. Run by tests/e2e/test_plugins_ranks.py::

    torchrun --standalone --nproc-per-node=2 tests/hf_ranks_site.py --coordinator HOST:PORT \
        --site-id a --out a.json
    python tests/hf_ranks_site.py --coordinator HOST:PORT --site-id b --seed 2 --out b.json

The model is a tiny GPT-2 built from a config (seeded: ``--seed``); the data are random token
ids with an attention mask of ``CONTEXT - PAD`` ones per sample (the padding's labels -100),
so a step's tokens are known: ``per-device batch x accumulation x ranks x (CONTEXT - PAD)``.
``--fsdp`` asks for Accelerate's FSDP2 (``fsdp="full_shard"``, version 2) instead of DDP:
Accelerate 1.16 does not shard on CPU (its state keeps ``MULTI_CPU``, the Trainer wraps the
model in DDP; the result file's ``distributed_type`` and ``is_fsdp_enabled`` say so).

Rank 0 writes to ``--out``: the hash of the whole θ after every round (by the round that
ended) and at the end, every rank's final hash, the loss the Trainer logged at each step,
the global step the Trainer stopped at and the round count.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os

import torch
import torch.distributed as dist
from site_args import coordinator_address, site_parser
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from diloco.outer import params_sha256
from diloco.plugins.hf import DiLoCoCallback

CONTEXT = 16
PAD = 4  # the last PAD positions of every sample are padding (attention_mask 0)
BATCH = 2  # per device
ACCUMULATE = 2


def build(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=CONTEXT, n_inner=64)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    """Random token ids (the same on every rank: the Trainer's sampler gives each rank its share)."""

    def __init__(self, n: int = 256) -> None:
        self.ids = torch.randint(0, 128, (n, CONTEXT), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(CONTEXT, dtype=torch.long)
        mask[CONTEXT - PAD :] = 0
        labels = self.ids[i].clone()
        labels[mask == 0] = -100
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": labels}


def whole_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole θ (sharded parameters gathered: collective under FSDP2)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}


class Probe(TrainerCallback):
    """Placed after DiLoCoCallback: hashes θ whenever a round has ended (every rank: a hash
    under FSDP2 gathers), and keeps the logged losses."""

    def __init__(self, diloco: DiLoCoCallback) -> None:
        self.diloco = diloco
        self.round = 0
        self.hashes: dict[str, str] = {}
        self.losses: dict[int, float] = {}

    def _check(self, model: torch.nn.Module) -> None:
        site = self.diloco.site
        if site is not None and site.round != self.round:
            self.hashes[str(self.round)] = params_sha256(whole_state(model))
            self.round = site.round

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._check(model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
        self._check(model)


def main() -> None:
    p = site_parser()
    p.add_argument("--fsdp", action="store_true")
    args = p.parse_args()
    faulthandler.dump_traceback_later(120, exit=True)  # a rank waiting for ever says where, and ends

    extra: dict = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if args.fsdp else {}
    if "WORLD_SIZE" in os.environ:  # under torchrun
        extra["ddp_backend"] = "gloo"
    targs = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), f"hf-{args.site_id}"),
        max_steps=100,  # the coordinator's last round stops it before
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=3e-3,
        logging_steps=args.sync_every,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )
    callback = DiLoCoCallback(coordinator=coordinator_address(args.coordinator, args.port_file), site_id=args.site_id, sync_every=args.sync_every)
    probe = Probe(callback)
    model = build(args.seed)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[callback, probe])
    trainer.train()
    final = params_sha256(whole_state(trainer.model))
    distributed = dist.is_available() and dist.is_initialized()
    finals = [None] * dist.get_world_size() if distributed else [final]
    if distributed:
        dist.all_gather_object(finals, final)
    if trainer.args.process_index == 0:
        result = {
            "round_sha256": probe.hashes,
            "global_sha256": final,
            "rank_sha256": finals,
            "losses": {str(k): v for k, v in probe.losses.items()},
            "global_step": trainer.state.global_step,
            "rounds": probe.round,
            "world_size": trainer.args.world_size,
            "model": type(trainer.model).__name__,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "is_fsdp_enabled": trainer.is_fsdp_enabled,
            "params": sum(p.numel() for p in build(0).parameters()),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    if distributed:
        # The Trainer's DDP wrapper is freed first: one freed after destroy_process_group hangs
        # now and then (torch 2.13, gloo: 3 of 8 runs of a plain Trainer, no DiLoCo involved).
        del trainer, model, probe, callback
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
