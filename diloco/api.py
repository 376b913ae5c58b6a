"""DiLoCo for an existing PyTorch loop, in three added lines::

    from diloco import DiLoCo
    with DiLoCo(model, optimizer, coordinator="10.0.0.1:50051", site_id="eu-1", sync_every=100):
        for x, y in loader:          # the user's loop, unchanged
            ...; loss.backward(); optimizer.step(); optimizer.zero_grad()

On entry the model is loaded with the coordinator's global parameters. A post-step hook on
the optimizer counts inner steps; every ``sync_every`` steps it pushes the pseudo-gradient,
waits for the round, and loads the new global parameters into the model. The optimizer's
state is the inner state and stays with the site. After the coordinator's last round the
hook stops syncing; on exit the site leaves the run.

Trainer plug-ins (diloco.plugins) drive the same object by hand instead: ``join()`` when
training starts, ``after_step()`` after every optimizer step (or ``step_done()`` and
``end_round()`` when the round must end a little later), and ``leave()`` when it ends.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any

import torch
from torch import nn

from diloco.codec import CodecConfig
from diloco.site.outer_sync import OuterSync
from diloco.transport import CoordinatorClient


def check_site_args(site_id: object, sync_every: object, tokens_per_step: object = 1) -> None:
    """Raises ValueError, naming the argument, for an empty ``site_id``, a ``sync_every``
    below 1 or a ``tokens_per_step`` below 1 (``None`` is allowed for tokens_per_step:
    the plug-ins then count tokens themselves)."""
    if site_id is None or not str(site_id).strip():
        raise ValueError(f"site_id={site_id!r}: must be a non-empty string")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every={sync_every!r}: must be >= 1")
    if tokens_per_step is not None and (isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1):
        raise ValueError(f"tokens_per_step={tokens_per_step!r}: must be >= 1")


class DiLoCo:
    """Makes the caller's training loop a DiLoCo site.

    ``tokens_per_step`` is the averaging weight of one inner step (the default 1 weights the
    sites by their step counts). ``record_loss(loss)`` is optional: the mean of the recorded
    losses over a round is reported to the coordinator's metrics.

    ``optimizer`` is needed only for the ``with`` form (its post-step hook counts the
    steps); without it, call ``join()``, ``after_step()`` and ``leave()`` yourself.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        coordinator: str,
        site_id: str,
        sync_every: int,
        tokens_per_step: int = 1,
        codec: CodecConfig | str = "fp32",
        connect_timeout_s: float = 120.0,
    ) -> None:
        check_site_args(site_id, sync_every, tokens_per_step)
        self.model = model
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.tokens_per_step = tokens_per_step
        self._client = CoordinatorClient(coordinator, connect_timeout_s=connect_timeout_s)
        self.sync = OuterSync(model, self._client, str(site_id), codec=codec)
        self._hook: Any = None
        self._steps_in_round = 0
        self._tokens_in_round = 0
        self._losses: list[float] = []
        self.steps = 0

    # ---- the with form -------------------------------------------------------------------
    def __enter__(self) -> DiLoCo:
        if self.optimizer is None:
            raise ValueError("optimizer=None: the with form needs the optimizer (to count its steps)")
        self.join()
        self._hook = self.optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self.after_step())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if exc_type is None:
            self.leave()
        else:
            self.close()

    # ---- explicit calls ------------------------------------------------------------------
    def join(self) -> None:
        """Joins the run and loads the coordinator's global θ into the model (the connection
        is closed again if that fails)."""
        try:
            self.sync.join()
        except BaseException:
            self.close()
            raise

    def after_step(self, tokens: int | None = None) -> bool:
        """Counts one inner (optimizer) step that saw ``tokens`` tokens (default
        ``tokens_per_step``); every ``sync_every`` steps ends the round (see ``end_round``).
        Returns True when this step ended a round. After the last round it only counts."""
        if self.step_done(tokens):
            self.end_round()
            return True
        return False

    def step_done(self, tokens: int | None = None) -> bool:
        """Counts one inner step that saw ``tokens`` tokens (default ``tokens_per_step``).
        Returns True when the round is due: the caller must then call ``end_round()``."""
        self.steps += 1
        if self.sync.finished:
            return False
        self._steps_in_round += 1
        self._tokens_in_round += self.tokens_per_step if tokens is None else tokens
        return self._steps_in_round >= self.sync_every

    def end_round(self) -> None:
        """Pushes the pseudo-gradient (weighted by the round's tokens, with the mean recorded
        loss), waits for the round to be committed and loads the new global θ."""
        loss = sum(self._losses) / len(self._losses) if self._losses else math.nan
        self.sync.sync(tokens=max(self._tokens_in_round, 1), train_loss=loss, inner_steps=self._steps_in_round)
        self._steps_in_round = 0
        self._tokens_in_round = 0
        self._losses = []

    def leave(self) -> None:
        """Leaves the run (reporting the hash of the site's global θ) and closes the connection."""
        try:
            self.sync.leave()
        finally:
            self.close()

    def close(self) -> None:
        """Stops the heartbeats and closes the connection without leaving (after a failure)."""
        self.sync.close()
        self._client.close()

    def record_loss(self, loss: torch.Tensor | float) -> None:
        self._losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))

    @property
    def round(self) -> int:
        return self.sync.round

    @property
    def finished(self) -> bool:
        """True once the coordinator's last round is done: there is nothing left to sync."""
        return self.sync.finished
