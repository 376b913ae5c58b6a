"""PyTorch Lightning as a DiLoCo site::

    from diloco.plugins.lightning import DiLoCoLightningCallback
    Trainer(callbacks=[DiLoCoLightningCallback(coordinator="10.0.0.1:50051", site_id="eu-1", sync_every=100)])

Needs ``lightning`` (``lightning.pytorch``). With a multi-process strategy every rank runs the
same callback: the ranks are one site (see ``DiLoCoLightningCallback``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from diloco.api import DiLoCo
from diloco.plugins.common import SiteSettings


class DiLoCoLightningCallback(Callback, SiteSettings):
    """Makes a Lightning ``Trainer`` run a DiLoCo site: one process, or every rank of a
    multi-process strategy (the site's ranks: ``process_group``, default the whole world).

    The synced parameters are the LightningModule's ``named_parameters()`` (names included,
    e.g. ``model.…`` for a module kept as ``self.model``): the coordinator must hold the same.

    Several ranks (``devices`` > 1 with a multi-process strategy; tested under torchrun): with ``strategy="ddp"`` each parameter is
    pushed by one of the ranks (the site's push comes in one part per rank) and the pulled θ
    broadcast to the others; with ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and/or
    tensor parallelism in ``configure_model``, which runs on CPU with gloo) each rank pushes
    and pulls the slices it holds. One rank joins and leaves for the site. ``FSDPStrategy``
    (FSDP1) cannot be a site: Lightning refuses it without a GPU, and its flat parameters are
    refused by the site (they hide which slices a rank holds).

    - ``on_train_start``: joins the coordinator and loads its global θ into the module, before
      the first step (in place: the optimizers keep their parameters);
    - ``on_train_batch_end``: counts optimizer steps as increments of ``trainer.global_step``
      (with gradient accumulation, only the batch that steps counts); every ``sync_every``
      steps pushes Δ = θ − θ_local, waits for the round and loads the new global θ;
    - after the coordinator's last round: syncs no more and sets ``trainer.should_stop``
      (Lightning honours it once ``min_epochs``/``min_steps`` are met);
    - ``on_train_end``: leaves the run, reporting the hash of the site's θ;
      ``on_exception``: closes the connection without leaving.

    The loss reported for a round is the mean over its steps of the loss ``training_step``
    returned (a tensor, or a dict's ``"loss"``), summed over the micro-batches of a step
    (Lightning has divided each by ``accumulate_grad_batches``); NaN if there was none. On
    several ranks each rank records its own losses and the site reports their mean.

    ``tokens_per_step``: the averaging weight of one step. ``None`` (default) counts the
    tokens of every batch of the step: the ones of a dict batch's ``attention_mask``, else
    the elements of its integer token tensor (the batch itself, a tuple/list batch's first
    element, or a dict batch's ``"input_ids"``); a step in which none was found counts 1.
    An int gives every step that weight. On several ranks each rank counts its own batches
    and the round's tokens are the sum over the site's ranks.

    Arguments (see ``SiteSettings``): ``coordinator``, ``site_id``, ``sync_every``, ``codec``,
    ``tokens_per_step``, and keyword-only the sync settings of ``diloco.DiLoCo``:
    ``error_feedback``, ``error_feedback_decay``, ``round_timeout_s``, ``connect_timeout_s``, ``security``,
    ``process_group``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        SiteSettings.__init__(self, *args, **kwargs)
        self.site: DiLoCo | None = None  # set at train start
        self._last_step = 0  # trainer.global_step when the last step was counted
        self._tokens = 0  # tokens of the batches since then
        self._loss: float | None = None  # their summed loss

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Joins the run and loads the global θ into the module."""
        site = self.join(pl_module)  # on a multi-rank site: every rank, collectively
        self.site = site
        self._last_step, self._tokens, self._loss = trainer.global_step, 0, None
        if site.finished:
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Adds the batch's tokens and loss; for each optimizer step taken, counts a step
        (ending the round when it is due) and stops the trainer after the last round."""
        site = self.site
        if site is None:
            return
        self._tokens += _batch_tokens(batch)
        loss = _loss(outputs)
        if loss is not None:
            self._loss = loss + (self._loss or 0.0)
        steps = trainer.global_step - self._last_step
        if steps <= 0:
            return  # accumulating gradients: no optimizer step yet
        self._last_step = trainer.global_step
        if self._loss is not None:
            site.record_loss(self._loss)
        tokens = self.tokens_per_step or max(self._tokens, 1)
        self._tokens, self._loss = 0, None
        for i in range(steps):  # more than one: several optimizers stepped (manual optimization)
            site.after_step(tokens if i == 0 else 0)
        if site.finished:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Leaves the run (reporting the hash of the site's θ)."""
        if self.site is not None:
            site, self.site = self.site, None
            site.leave()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Closes the connection without leaving (the coordinator evicts the site when its lease ends)."""
        if self.site is not None:
            site, self.site = self.site, None
            site.close()


def _batch_tokens(batch: Any) -> int:
    """Tokens in a batch, as the class docstring says (0 if none are found)."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        batch = batch.get("input_ids")
    elif isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    if isinstance(batch, torch.Tensor) and not (batch.is_floating_point() or batch.is_complex()):
        return batch.numel()
    return 0


def _loss(outputs: Any) -> float | None:
    """The loss in a training_step's output (a tensor, a number or a dict's "loss"), if finite."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        outputs = float(outputs.detach())
    if isinstance(outputs, (int, float)) and math.isfinite(outputs):
        return float(outputs)
    return None
