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


class DiLoCo:
    """Makes the caller's training loop a DiLoCo site.

    ``tokens_per_step`` is the averaging weight of one inner step (the default 1 weights the
    sites by their step counts). ``record_loss(loss)`` is optional: the mean of the recorded
    losses over a round is reported to the coordinator's metrics.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        coordinator: str,
        site_id: str,
        sync_every: int,
        tokens_per_step: int = 1,
        codec: CodecConfig | str = "fp32",
        connect_timeout_s: float = 120.0,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every={sync_every}: must be >= 1")
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step={tokens_per_step}: must be >= 1")
        self.model = model
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.tokens_per_step = tokens_per_step
        self._client = CoordinatorClient(coordinator, connect_timeout_s=connect_timeout_s)
        self.sync = OuterSync(model, self._client, str(site_id), codec=codec)
        self._hook: Any = None
        self._steps_in_round = 0
        self._losses: list[float] = []
        self.steps = 0

    def __enter__(self) -> DiLoCo:
        try:
            self.sync.join()
        except BaseException:
            self._client.close()
            raise
        self._hook = self.optimizer.register_step_post_hook(self._after_step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        try:
            if exc_type is None:
                self.sync.leave()
        finally:
            self.sync.close()
            self._client.close()

    def record_loss(self, loss: torch.Tensor | float) -> None:
        self._losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))

    @property
    def round(self) -> int:
        return self.sync.round

    def _after_step(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.steps += 1
        if self.sync.finished:
            return
        self._steps_in_round += 1
        if self._steps_in_round < self.sync_every:
            return
        loss = sum(self._losses) / len(self._losses) if self._losses else math.nan
        self.sync.sync(tokens=self._steps_in_round * self.tokens_per_step, train_loss=loss, inner_steps=self._steps_in_round)
        self._steps_in_round = 0
        self._losses = []
