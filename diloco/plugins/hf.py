"""Hugging Face ``transformers.Trainer`` as a DiLoCo site::

    from diloco.plugins.hf import DiLoCoCallback
    Trainer(model, args, train_dataset=ds,
            callbacks=[DiLoCoCallback(coordinator="10.0.0.1:50051", site_id="eu-1", sync_every=100)])

Needs ``transformers`` (and the ``accelerate`` its Trainer uses). Under ``torchrun`` every rank
runs the same Trainer with the same callback: the ranks are one site (see ``DiLoCoCallback``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from diloco.api import DiLoCo
from diloco.plugins.common import SiteSettings
from diloco.site.layouts.base import see_through


class DiLoCoCallback(TrainerCallback, SiteSettings):
    """Makes a ``transformers.Trainer`` run a DiLoCo site: one process, or every rank of a
    torchrun group (the site's ranks: ``process_group``, default the whole world).

    - train begin: joins the coordinator and loads its global θ into the model, before the
      first step (in place, so the optimizer the Trainer already built keeps its parameters);
    - every optimizer step (``on_step_end``): counts it; every ``sync_every`` steps pushes
      Δ = θ − θ_local, waits for the round and loads the new global θ;
    - after the coordinator's last round: syncs no more and sets
      ``control.should_training_stop``;
    - train end: leaves the run, reporting the hash of the site's θ.

    Several ranks: the Trainer wraps the model in DDP itself and gives callbacks the model
    inside (the callback sees through DDP, DataParallel and ``torch.compile`` wrappers either
    way). Every rank loads the global θ and counts its steps; each parameter is pushed by one
    of the ranks holding it (a DDP site's push comes in one part per rank) and the pulled θ
    is broadcast to the others; one rank joins and leaves for the site. FSDP2 parameters
    (DTensors) would be synced as each rank's slices, but Accelerate (1.16) does not shard on
    CPU: ``AcceleratorState`` sets ``DistributedType.FSDP`` only for multi-GPU/XPU/NPU/...
    types, so ``fsdp="full_shard"`` with gloo on CPU silently trains with DDP
    (``trainer.is_fsdp_enabled`` is False). FSDP1 (``fsdp_version`` 1, on GPUs) is refused at
    train begin: its flat parameters hide which slices a rank holds.

    The loss reported for a round is the mean of the ``loss`` values the Trainer logged in
    it (NaN if it logged none: set ``logging_steps`` to at most ``sync_every``); on several
    ranks the Trainer logs on every rank the loss averaged over the ranks, so the round's
    loss is the site's. The Trainer logs a step just after ``on_step_end``, so when the
    round's last step is also a logging step, the round ends in ``on_log``, right after that
    loss is logged.

    ``tokens_per_step``: the averaging weight of one step. ``None`` (default) counts the
    tokens the model really saw: for every training forward pass (each micro-batch of
    gradient accumulation) the number of ones in ``attention_mask`` if it is given, else
    the number of elements of the model's main input (``input_ids``); a step in which none
    was seen counts 1. An int gives every step that weight. On several ranks each rank counts
    its own micro-batches and the round's tokens are the sum over the site's ranks (an int:
    ``tokens_per_step`` per step of each rank, summed alike).

    Arguments (see ``SiteSettings``): ``coordinator``, ``site_id``, ``sync_every``, ``codec``,
    ``tokens_per_step``, and keyword-only the sync settings of ``diloco.DiLoCo``:
    ``error_feedback``, ``error_feedback_decay``, ``round_timeout_s``, ``connect_timeout_s``, ``security``,
    ``process_group``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        SiteSettings.__init__(self, *args, **kwargs)
        self.site: DiLoCo | None = None  # set at train begin
        self._hook: Any = None
        self._tokens = 0  # tokens counted since the last step ended
        self._round_due = False  # the round's last step waits for its loss to be logged

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: nn.Module | None = None, **kwargs: Any) -> None:
        """Joins the run and loads the global θ into the model."""
        if model is None:
            raise ValueError("DiLoCoCallback: the Trainer passed no model")
        site = self.join(model)  # on a multi-rank site: every rank, collectively
        self.site = site
        self._tokens, self._round_due = 0, False
        if self.tokens_per_step is None:
            main_input = getattr(see_through(model), "main_input_name", "input_ids")
            self._hook = model.register_forward_pre_hook(lambda m, a, kw: self._count_tokens(m, a, kw, main_input), with_kwargs=True)
        if site.finished:
            control.should_training_stop = True

    def _count_tokens(self, module: nn.Module, args: tuple, kwargs: dict, main_input: str) -> None:
        """Forward pre-hook: adds the tokens of a training forward pass."""
        if not module.training:
            return
        mask, ids = kwargs.get("attention_mask"), kwargs.get(main_input, args[0] if args else None)
        if isinstance(mask, torch.Tensor):
            self._tokens += int(mask.sum())
        elif isinstance(ids, torch.Tensor):
            self._tokens += ids.numel()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Counts the optimizer step; ends the round when it is due (now, or in on_log)."""
        if self.site is None:
            return
        tokens = self.tokens_per_step or max(self._tokens, 1)
        self._tokens = 0
        if self.site.step_done(tokens):
            if control.should_log:
                self._round_due = True  # the Trainer logs this step's loss next: end the round in on_log
            else:
                self._end_round(control)
        elif self.site.finished:
            control.should_training_stop = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        """Records the logged training loss; ends a round that waited for it."""
        if self.site is None:
            return
        loss = (logs or {}).get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            self.site.record_loss(loss)
        if self._round_due:
            self._end_round(control)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Ends a round still waiting for a log that did not come."""
        if self._round_due:
            self._end_round(control)

    def _end_round(self, control: TrainerControl) -> None:
        assert self.site is not None
        self._round_due = False
        self.site.end_round()
        if self.site.finished:
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Ends a pending round, then leaves the run (reporting the hash of the site's θ)."""
        if self.site is None:
            return
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        site = self.site
        try:
            if self._round_due:
                self._end_round(control)
        except BaseException:
            site.close()
            raise
        finally:
            self.site = None
        site.leave()
