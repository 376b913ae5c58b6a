"""A torchtitan training job as a DiLoCo site, through torchtitan's own extension point: a
``Trainer`` subclass with its own ``Config`` (as torchtitan's ``experiments/torchft`` does for
torchft's DiLoCo)::

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from diloco.plugins.torchtitan import DiLoCoTrainer, site_config

    config = site_config(llama3_debugmodel(), coordinator="10.0.0.1:50051", site_id="eu-1", sync_every=100)
    trainer = config.build()   # every rank, under torchrun: torchtitan builds and parallelises the model
    trainer.train()            # joins, trains H steps per round, stops after the coordinator's last round, leaves
    trainer.close()

or with torchtitan's own launcher and command line (``--diloco.*`` are this config's fields)::

    torchrun --nproc-per-node=8 -m torchtitan.train --module diloco.plugins.torchtitan \
        --config llama3_debugmodel_diloco --diloco.coordinator 10.0.0.1:50051 --diloco.site-id eu-1

Needs ``torchtitan`` (``pip install diloco[torchtitan]``); torchtitan 0.3.0's trainer runs on a
GPU only (docs/torchtitan.md says where it stops on a CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

try:
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.trainer import Trainer
except ImportError as e:  # the optional extra is missing (torchtitan, or one of the packages it imports)
    raise ImportError(f"diloco.plugins.torchtitan needs torchtitan and its dependencies: pip install diloco[torchtitan] ({e})") from e

from diloco.api import DiLoCo
from diloco.security.config import SecurityConfig
from diloco.site.arguments import check_site_args, check_sync_args

__all__ = ["DiLoCoSiteConfig", "DiLoCoTrainer", "ModelParts", "counts_tokens", "llama3_debugmodel_diloco", "site_config", "site_model"]


@dataclass(kw_only=True, slots=True)
class DiLoCoSiteConfig:
    """The ``diloco`` section of a ``DiLoCoTrainer.Config`` (on torchtitan's command line:
    ``--diloco.coordinator``, ``--diloco.site-id``, ...). The fields are the arguments of
    ``diloco.DiLoCo``; ``None`` takes the coordinator's setting."""

    coordinator: str = ""
    """The coordinator's host:port."""
    site_id: str = ""
    """This site's id in the run (every rank of the job gives the same)."""
    sync_every: int | None = None
    """H, the inner steps of a round; None: the run's."""
    codec: str | None = None
    """The codec of the pushes (fp32, bf16, int8, ...); None: the run's."""
    error_feedback: bool | None = None
    error_feedback_decay: float | None = None
    round_timeout_s: float = 3600.0
    """How long a rank waits for a round to be committed."""
    connect_timeout_s: float = 120.0
    credentials_dir: str | None = None
    """The directory diloco-certs wrote for this site (TLS and token); None: plaintext (loopback only unless insecure)."""
    insecure: bool = False
    """Allow plaintext to a coordinator off loopback."""

    def check(self) -> None:
        """ValueError naming the field for a missing coordinator or site id, or a bad value."""
        if not self.coordinator.strip():
            raise ValueError("diloco.coordinator is empty: give the coordinator's host:port (--diloco.coordinator)")
        check_site_args(self.site_id, self.sync_every)
        check_sync_args(self.error_feedback, self.error_feedback_decay, self.round_timeout_s)

    def security(self) -> SecurityConfig | None:
        if self.credentials_dir is None and not self.insecure:
            return None
        return SecurityConfig(dir=self.credentials_dir, insecure=self.insecure)


class ModelParts(nn.Module):
    """The model parts one rank holds (torchtitan's ``model_parts``: several pipeline stages
    with an interleaved schedule) as one module for ``DiLoCo``, whose parameters keep
    torchtitan's names (``layers.3.attention.wo.weight``, not ``0.layers.3...``): the parts are
    not registered as submodules, ``named_parameters`` chains theirs. Two parts holding the same
    name are refused."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = list(parts)  # a plain list: registered parts would prefix the names
        seen: set[str] = set()
        for part in self.parts:
            for name, _ in part.named_parameters():
                if name in seen:
                    raise ValueError(f"parameter {name!r} is held by two model parts of this rank: DiLoCo needs one name per tensor")
                seen.add(name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for part in self.parts:
            yield from part.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ModelParts only lists the parameters of a rank's model parts; the trainer runs the parts")


def site_model(model_parts: Sequence[nn.Module]) -> nn.Module:
    """What ``DiLoCo`` syncs on this rank: the one model part, or the parts as ``ModelParts``."""
    return model_parts[0] if len(model_parts) == 1 else ModelParts(model_parts)


def counts_tokens(parallel_dims: Any) -> bool:
    """Whether this rank counts the tokens of its batches: the ranks of one pipeline, context-
    and tensor-parallel group all draw the same batches, so only their first one counts (the
    site's step weight is the sum over its ranks)."""
    for axis in ("pp", "cp", "tp"):
        mesh = parallel_dims.get_optional_mesh(axis)
        if mesh is not None and mesh.get_local_rank() != 0:
            return False
    return True


class _Counted:
    """The trainer's data iterator, counting the valid labels of every batch drawn from it."""

    def __init__(self, it: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        self.it = it
        self.tokens = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        input_dict, labels = next(self.it)
        self.tokens += int((labels != IGNORE_INDEX).sum())  # the batch is still on the CPU here
        return input_dict, labels


class DiLoCoTrainer(Trainer):
    """torchtitan's ``Trainer`` as a DiLoCo site (every rank of the job runs it; the job is
    one site). torchtitan builds, parallelises and initialises the model and builds its
    optimizers, unchanged; then:

    - ``should_continue_training``, first called after the checkpoint is loaded and before
      the first step: makes ``DiLoCo(model, ...)`` on every rank (its ranks' shares found from
      the DTensor placements torchtitan's parallelisms gave) and joins: the coordinator's θ is
      loaded into the model in place (a checkpoint's θ is replaced, the optimizer state kept);
      afterwards, False once the coordinator's last round is done (or at
      ``training.steps``, torchtitan's own limit: set it to at least rounds × H);
    - ``train_step``: torchtitan's step, then counts it with the valid tokens of the batches
      it drew (labels not ``IGNORE_INDEX``, on the first rank of each pipeline/context/tensor
      group); every H steps ends the round: each rank pushes Δ of its share, waits, and loads
      the new global θ;
    - ``forward_backward_step``: torchtitan's, keeping the loss (on device, no sync) for the
      round's mean loss (each rank's mean loss per token, averaged over the ranks that have one);
    - ``train``: torchtitan's loop, then leaves the run (the leader reporting the θ hash), or
      closes the connection if the loop raised.

    With pipeline parallelism a rank's ``model_parts`` are synced as one module keeping
    torchtitan's parameter names (``ModelParts``). torchtitan's default
    ``parallelism.spmd_backend="spmd_types"`` keeps plain local tensors, not DTensors, which
    DiLoCo cannot place (and which torch 2.13's ``fully_shard`` refuses): use
    ``"partial_dtensor"`` or ``"full_dtensor"`` (``site_config`` sets ``"partial_dtensor"``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        diloco: DiLoCoSiteConfig = field(default_factory=DiLoCoSiteConfig)

    config: Config
    diloco_site: DiLoCo | None

    def __init__(self, config: Config) -> None:
        config.diloco.check()  # before torchtitan builds anything
        super().__init__(config)
        self.diloco_site = None
        self._counts_tokens = counts_tokens(self.parallel_dims)
        self._step_loss: torch.Tensor | None = None  # this step's loss, summed over its micro-batches
        self._step_global_tokens: torch.Tensor | None = None
        self._round_loss: torch.Tensor | None = None  # the round's per-step mean losses, summed (on device)
        self._round_losses = 0

    # ---- joining and stopping ---------------------------------------------------------------
    def join_site(self) -> DiLoCo:
        """Makes this rank's ``DiLoCo`` over the trainer's model parts and joins the run."""
        s = self.config.diloco
        site = DiLoCo(
            site_model(self.model_parts), None, coordinator=s.coordinator, site_id=s.site_id, sync_every=s.sync_every,
            codec=s.codec, error_feedback=s.error_feedback, error_feedback_decay=s.error_feedback_decay,
            round_timeout_s=s.round_timeout_s, connect_timeout_s=s.connect_timeout_s, security=s.security(),
        )  # fmt: skip
        site.join()  # closes the connection again if it fails
        self.diloco_site = site
        return site

    def should_continue_training(self) -> bool:
        site = self.diloco_site if self.diloco_site is not None else self.join_site()
        return not site.finished and super().should_continue_training()

    # ---- a step -----------------------------------------------------------------------------
    def forward_backward_step(self, *, input_dict: Any, labels: Any, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        if not self.parallel_dims.pp_enabled or self.pp_has_last_stage:
            value = loss.detach().float().sum().clone()  # a copy: a CUDA graph's output is overwritten by its next replay
            self._step_loss = value if self._step_loss is None else self._step_loss + value
            self._step_global_tokens = global_valid_tokens
        return loss

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        site = self.diloco_site
        if site is None:  # driven without train(): join now
            site = self.join_site()
        counted = _Counted(data_iterator)
        self._step_loss = None
        super().train_step(counted)
        if self._step_loss is not None and counted.tokens > 0:
            # torchtitan's loss is this rank's summed loss / the step's global valid tokens
            assert self._step_global_tokens is not None
            mean = self._step_loss * self._step_global_tokens / counted.tokens
            self._round_loss = mean if self._round_loss is None else self._round_loss + mean
            self._round_losses += 1
        if site.step_done(counted.tokens if self._counts_tokens else 0):
            if self._round_loss is not None:
                site.record_loss(self._round_loss / self._round_losses)  # one device sync per round
            site.end_round()
            self._round_loss, self._round_losses = None, 0

    # ---- the whole run ----------------------------------------------------------------------
    def train(self) -> None:
        try:
            super().train()
        except BaseException:
            if self.diloco_site is not None:
                self.diloco_site.close()
            raise
        if self.diloco_site is not None:
            self.diloco_site.leave()


def site_config(base: Trainer.Config, **diloco: Any) -> DiLoCoTrainer.Config:
    """``base`` (any torchtitan trainer config, e.g. ``llama3_debugmodel()``) as a
    ``DiLoCoTrainer.Config`` whose ``diloco`` section has the given fields, and with
    ``parallelism.spmd_backend="partial_dtensor"`` (parameters as DTensors, which DiLoCo places)."""
    if type(base) is not Trainer.Config:
        raise ValueError(f"site_config: base is a {type(base).__name__}; give a torchtitan Trainer.Config (a subclass has its own trainer)")
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    values["parallelism"] = dataclasses.replace(base.parallelism, spmd_backend="partial_dtensor")
    return DiLoCoTrainer.Config(**values, diloco=DiLoCoSiteConfig(**diloco))


def llama3_debugmodel_diloco() -> DiLoCoTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` as a DiLoCo site, for ``--module diloco.plugins.torchtitan
    --config llama3_debugmodel_diloco`` (give ``--diloco.coordinator`` and ``--diloco.site-id``)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return site_config(llama3_debugmodel())
