"""DiLoCo for an existing PyTorch loop, in three added lines::

    from diloco import DiLoCo, SecurityConfig
    creds = SecurityConfig(dir="run-creds")  # what diloco-certs wrote for this site: ca.pem, sites/eu-1.*
    with DiLoCo(model, optimizer, coordinator="coord.example.com:50051", site_id="eu-1", sync_every=100, security=creds) as dl:
        for x, y in loader:          # the user's loop, unchanged but for the marked lines
            loss = loss_fn(model(x), y); loss.backward()
            dl.record_loss(loss, tokens=x.numel())   # optional: the step's loss and tokens, BEFORE optimizer.step()
            optimizer.step(); optimizer.zero_grad()
            if dl.finished:          # optional: stop after the coordinator's last round
                break

On entry the model is loaded with the coordinator's global parameters (in place, on whatever
device they are). A post-step hook on the optimizer counts inner steps; every ``sync_every``
steps it pushes the pseudo-gradient, waits for the round, and loads the new global parameters
into the model. The optimizer's state is the inner state and stays with the site. After the
coordinator's last round the hook stops syncing: the next optimizer step warns once that the
run is finished and steps are local only (``after_last_round="raise"``: raises ``RunFinished``
instead); on exit the site leaves the run.

Each step's averaging weight is the tokens given to ``add_tokens(n)`` (or
``record_loss(loss, tokens=n)``) since the previous step, or ``tokens_per_step`` when none were
given. ``dropped_rounds``, ``merged_rounds`` and ``rejoins`` tell which rounds went on without
this site's work.

Trainer plug-ins (diloco.plugins) drive the same object by hand instead: ``join()`` when
training starts, ``after_step()`` after every optimizer step (or ``step_done()`` and
``end_round()`` when the round must end a little later), and ``leave()`` when it ends.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from types import TracebackType
from typing import Any

import torch
from torch import nn

from diloco.codec import CodecConfig
from diloco.security.config import SecurityConfig
from diloco.site.arguments import RunNotServed, check_site_args, check_sync_args, check_tokens, served_problem, stated_settings
from diloco.site.exchange import Timeouts
from diloco.site.layouts.base import ParallelModel, unwrap
from diloco.site.layouts.build import site_group
from diloco.site.outer_sync import OuterSync, SyncOptions
from diloco.transport import CoordinatorClient

AFTER_LAST_ROUND = ("warn", "raise")


class RunFinished(RuntimeError):
    """Raised by the ``with`` form's step hook for an optimizer step taken after the
    coordinator's last round, when ``after_last_round="raise"``. The step itself has been
    taken (locally; nothing is synced any more). Leaving the ``with`` block with this
    exception still leaves the run cleanly."""


class RunFinishedWarning(UserWarning):
    """Warned (once per ``DiLoCo`` object) for the first optimizer step after the
    coordinator's last round, when ``after_last_round="warn"`` (the default)."""


def _holds_dtensors(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (False while torch.distributed.tensor is
    not imported: then none can be one, and a one-process site does not pay for importing it)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame, above the function that calls this one, outside
    this module and torch (the user's ``optimizer.step()`` line), for ``warnings.warn``."""
    skip = (os.path.dirname(torch.__file__) + os.sep, __file__)
    frame, level = sys._getframe(2), 2  # level 1: the caller, which warns; 2: its caller
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


class DiLoCo:
    """Makes the caller's training loop a DiLoCo site.

    ``tokens_per_step`` is the averaging weight of one inner step when the loop gives no
    token count (the default 1 weights the sites by their step counts); ``add_tokens(n)``
    gives the real count of a step. ``record_loss(loss)`` is optional: the mean of the
    recorded losses over a round is reported to the coordinator's metrics.

    ``codec``, ``error_feedback`` (carry what a lossy codec dropped into the next push; no
    effect with the lossless ``fp32``), ``error_feedback_decay`` (β in [0, 1]: the share of
    the last residual added; None: the codec's best, 0.8 for topk2bit, else 1) and
    ``round_timeout_s`` (how long a site waits for a round to
    be committed before ``end_round`` raises) are the site's sync settings (see OuterSync).

    ``after_last_round``: what the ``with`` form's step hook does with an optimizer step
    taken after the coordinator's last round (the step is local only: nothing is synced
    any more): ``"warn"`` (default) warns once (``RunFinishedWarning``), ``"raise"`` raises
    ``RunFinished`` from ``optimizer.step()`` (the step has been taken). Test ``finished``
    to stop the loop. The explicit calls (``after_step``, used by the plug-ins) neither
    warn nor raise: they count the step and return False.

    The model is never moved: the global θ is loaded into its parameters in place, on
    whatever device they are.

    ``security``: the run's credentials (``SecurityConfig(dir=...)``: TLS with the site's
    certificate and token). Without it the channel is plaintext, which is refused off
    loopback unless ``SecurityConfig(insecure=True)`` says so.

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
        sync_every: int | None = None,
        tokens_per_step: int = 1,
        codec: CodecConfig | str | None = None,
        error_feedback: bool | None = None,
        error_feedback_decay: float | None = None,
        round_timeout_s: float = 3600.0,
        after_last_round: str = "warn",
        connect_timeout_s: float = 120.0,
        security: SecurityConfig | None = None,
        process_group: Any = None,
    ) -> None:
        group = site_group(process_group)
        if group is None and _holds_dtensors(model):
            # One rank whose trainer still made its parameters DTensors (torchtitan wraps every
            # model in fully_shard, of degree 1 here): found from their placements, as for many ranks.
            group = process_group if process_group is not None else torch.distributed.group.WORLD
        if group is not None:  # every rank's arguments, compared before any of them is checked
            given = {"site_id": site_id, "coordinator": coordinator, "sync_every": sync_every, "codec": codec}
            given.update(error_feedback=error_feedback, error_feedback_decay=error_feedback_decay)
            given = {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for k, v in given.items()}
            from diloco.site.layouts.found import FoundModel  # DTensor's machinery: only for a multi-rank site

            layout: ParallelModel = FoundModel(model, group, given)
        check_site_args(site_id, sync_every, tokens_per_step)
        check_sync_args(error_feedback, error_feedback_decay, round_timeout_s)
        if after_last_round not in AFTER_LAST_ROUND:
            raise ValueError(f"after_last_round={after_last_round!r}: must be one of {', '.join(map(repr, AFTER_LAST_ROUND))}")
        self.model = model
        self.optimizer = optimizer
        self.tokens_per_step = tokens_per_step
        self.after_last_round = after_last_round
        self._client = CoordinatorClient(coordinator, connect_timeout_s=connect_timeout_s, security=security, site_id=str(site_id))
        own, stated = stated_settings(sync_every=sync_every, codec=codec, error_feedback=error_feedback, error_feedback_decay=error_feedback_decay)
        # The run's settings are the coordinator's; what is given here is stated at Join, where
        # a run with other values refuses this site, naming the setting.
        options = SyncOptions(own=own, stated=stated, timeouts=Timeouts(round_timeout_s=float(round_timeout_s)))
        # A diverged round (Δ not finite) restarts from θ; the optimizer's state had the NaN too.
        self.layout: ParallelModel = layout if group is not None else ParallelModel(unwrap(model))
        self.sync = OuterSync(self.layout, self._client, str(site_id), options, on_diverged=optimizer.state.clear if optimizer is not None else None)
        self._hook: Any = None
        self._steps_in_round = 0
        self._tokens_in_round = 0  # tokens counted (given) in the open round
        self._default_tokens = 0  # the weight of its steps that counted none (tokens_per_step each)
        self._pending_tokens: int | None = None  # add_tokens() since the last step; None: none added
        self._losses: list[float] = []
        self._warned = False
        self.steps = 0
        self.steps_after_last_round = 0  # optimizer steps counted after the coordinator's last round (local only)

    # ---- the with form -------------------------------------------------------------------
    def __enter__(self) -> DiLoCo:
        if self.optimizer is None:
            raise ValueError("optimizer=None: the with form needs the optimizer (to count its steps)")
        self.join()
        self._hook = self.optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self._optimizer_stepped())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if exc_type is None or issubclass(exc_type, RunFinished):
            self.leave()  # RunFinished: the run itself is over and fine; the exception goes on
        else:
            self.close()

    def _optimizer_stepped(self) -> None:
        """The optimizer's post-step hook: counts the step (ending the round when it is due);
        after the last round, warns once or raises, as ``after_last_round`` says."""
        late = self.sync.finished
        self.after_step()
        if not late:
            return
        message = (
            f"DiLoCo site {self.sync.site_id!r}: optimizer step after the coordinator's last round "
            f"({self.sync.total_rounds} rounds done): the run is finished and this step is local only; "
            f"stop the loop when dl.finished is True"
        )
        if self.after_last_round == "raise":
            raise RunFinished(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, RunFinishedWarning, stacklevel=_caller_stacklevel())

    # ---- explicit calls ------------------------------------------------------------------
    def join(self) -> None:
        """Joins the run and loads the coordinator's global θ into the model (the connection
        is closed again if that fails). A run this object cannot serve (a streaming or
        overlapped one: ``served_problem``) is refused by name, and the site leaves it."""
        try:
            self.sync.join()
        except BaseException:
            self.close()
            raise
        why = served_problem(self.sync.settings)
        if why is not None:
            self.leave()
            raise RunNotServed(why)

    @property
    def sync_every(self) -> int:
        """The inner steps of the open round: the run's H (its sync.schedule's in the first rounds)."""
        return self.sync.settings.schedule.steps_of(self.sync.round)

    def add_tokens(self, n: int) -> None:
        """Adds ``n`` (an integer >= 0) to the tokens the current inner step trains on: call it
        before ``optimizer.step()`` (e.g. once per micro-batch with gradient accumulation).
        The next counted step takes the sum of what was added since the previous step as its
        averaging weight, instead of ``tokens_per_step``; a step with nothing added falls back
        to ``tokens_per_step``. Tokens added after the step count toward the next one."""
        n = check_tokens(n, "n")
        self._pending_tokens = (self._pending_tokens or 0) + n

    def after_step(self, tokens: int | None = None) -> bool:
        """Counts one inner (optimizer) step that saw ``tokens`` tokens (default: those added
        with ``add_tokens`` since the last step, else ``tokens_per_step``); every
        ``sync_every`` steps ends the round (see ``end_round``). Returns True when this step
        ended a round. After the last round it only counts."""
        if self.step_done(tokens):
            self.end_round()
            return True
        return False

    def step_done(self, tokens: int | None = None) -> bool:
        """Counts one inner step that saw ``tokens`` tokens (default: those added with
        ``add_tokens`` since the last step, else ``tokens_per_step``; a given count wins over
        the added ones, which are then discarded). Returns True when the round is due: the
        caller must then call ``end_round()``."""
        counted = tokens is not None or self._pending_tokens is not None
        if tokens is None:
            tokens = self.tokens_per_step if self._pending_tokens is None else self._pending_tokens
        else:
            tokens = check_tokens(tokens)
        self._pending_tokens = None
        self.steps += 1
        if self.sync.finished:
            self.steps_after_last_round += 1
            return False
        self._steps_in_round += 1
        if counted:
            self._tokens_in_round += tokens
        else:
            self._default_tokens += tokens
        return self._steps_in_round >= self.sync_every

    def end_round(self) -> None:
        """Pushes the pseudo-gradient (weighted by the round's tokens, with the mean recorded
        loss), waits for the round to be committed (at most ``round_timeout_s``) and loads the
        new global θ. If the round was committed without this push (too late), or the site was
        evicted, the round's work is dropped (see ``dropped_rounds``) and the site goes on
        from the coordinator's current θ."""
        if self.layout.world == 1:
            tokens = self._tokens_in_round + self._default_tokens
            loss = sum(self._losses) / len(self._losses) if self._losses else math.nan
        else:  # the tokens the ranks counted, summed (the steps' default weight only where no rank counted any)
            counted, loss_sum, losses, default = self.layout.sum([self._tokens_in_round, sum(self._losses), len(self._losses), self._default_tokens])
            tokens = counted if counted > 0 else default / self.layout.world
            loss = loss_sum / losses if losses else math.nan
        self.sync.sync(tokens=max(int(tokens), 1), train_loss=loss, inner_steps=self._steps_in_round)
        self._steps_in_round = 0
        self._tokens_in_round = 0
        self._default_tokens = 0
        self._losses = []

    def leave(self) -> None:
        """Leaves the run (the leader rank, reporting the hash of the site's global θ) and
        closes the connection (every rank must call it)."""
        try:
            digest = self.global_sha256()
            if self.layout.leader:
                self.sync.leave(digest)
        finally:
            self.close()

    def global_sha256(self) -> str:
        """The hash of the site's copy of the global θ (params_sha256 of the whole tensors).
        On a multi-rank site every rank must call it: the ranks' slices are gathered to rank 0
        one tensor at a time: for checks, not for every round."""
        if self.layout.world == 1:
            return self.sync.global_sha256()
        return self.layout.whole_sha256(self.sync.global_params)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stops the heartbeats and closes the connection without leaving (after a failure)."""
        self.sync.close()
        self._client.close()

    def record_loss(self, loss: torch.Tensor | float, tokens: int | None = None) -> None:
        """Records a training loss (a number, or a one-element tensor on any device) for the
        round's mean loss; ``tokens=n`` also calls ``add_tokens(n)`` (then call it before
        ``optimizer.step()``)."""
        if tokens is not None:
            tokens = check_tokens(tokens)
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._losses.append(value)
        if tokens is not None:
            self._pending_tokens = (self._pending_tokens or 0) + tokens

    @property
    def round(self) -> int:
        return self.sync.round

    @property
    def total_rounds(self) -> int:
        """The coordinator's number of rounds (known after joining)."""
        return self.sync.total_rounds

    @property
    def finished(self) -> bool:
        """True once the coordinator's last round is done: there is nothing left to sync."""
        return self.sync.finished

    @property
    def dropped_rounds(self) -> list[int]:
        """The rounds committed without this site's push (it came too late, or the site had
        been evicted): their local work did not count, and the site went on from the
        coordinator's θ. Empty when every push counted."""
        return list(self.sync.stats.dropped_rounds)

    @property
    def merged_rounds(self) -> list[int]:
        """The rounds whose push came late but was merged, discounted, into a later round
        (coordinator option ``late="merge"``): the work counted, the site then went on from
        the coordinator's θ."""
        return list(self.sync.stats.merged_rounds)

    @property
    def rejoins(self) -> int:
        """How many times the site had to join the run again (it had been evicted)."""
        return self.sync.stats.rejoins
