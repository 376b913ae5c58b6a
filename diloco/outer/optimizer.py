"""The outer optimizer: treats the averaged pseudo-gradient as a gradient of θ."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.schedule import OuterSchedule

MOMENTUM_OPTIMIZERS = ("SGD", "DelayedNesterov")  # those whose momentum a schedule can set


@dataclass(frozen=True)
class OuterConfig:
    """A resolved outer step (a run's comes from its ``outer`` section: diloco.outer.defaults):
    any torch.optim optimizer by class name, or ``DelayedNesterov``; the default is DiLoCo's
    Nesterov SGD. ``period`` is DelayedNesterov's: outer steps between momentum updates.
    ``lr_warmup``, ``lr_decay``, ``lr_min_ratio`` and ``momentum_warmup``: the schedules of
    diloco.outer.schedule (none by default)."""

    name: str = "SGD"
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    period: int = 4
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra constructor arguments
    lr_warmup: int = 0  # outer steps of a linear lr warm-up (0: none)
    lr_decay: str = "none"  # none | linear | cosine, after the warm-up, to lr_min_ratio x lr at the end
    lr_min_ratio: float = 0.0
    momentum_warmup: int = 0  # outer steps of a linear momentum warm-up from 0 (0: none)
    # Each parameter's last outer step is an average (θ − mean Δ) instead: the run ends on what
    # the sites trained, not extrapolated once more by the momentum (docs/outer.md).
    final_average: bool = False

    def __post_init__(self) -> None:
        if self.name != "DelayedNesterov" and not isinstance(getattr(torch.optim, self.name, None), type):
            raise ValueError(f"outer.name={self.name!r}: neither DelayedNesterov nor an optimizer class in torch.optim")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"outer.lr={self.lr}: must be a finite number > 0")
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)) or not (math.isfinite(self.momentum) and self.momentum >= 0):
            raise ValueError(f"outer.momentum={self.momentum}: must be a finite number >= 0")
        for flag in ("nesterov", "final_average"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"outer.{flag}={getattr(self, flag)!r}: must be true or false")
        schedule = self.schedule  # checks its own fields
        if schedule.momentum_warmup and self.name not in MOMENTUM_OPTIMIZERS:
            raise ValueError(f"outer.momentum_warmup={schedule.momentum_warmup}: only for {' and '.join(MOMENTUM_OPTIMIZERS)} (outer.name={self.name})")
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"outer.period={self.period!r}: must be an integer >= 1")
        if self.name == "DelayedNesterov" and not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"outer.momentum={self.momentum}: DelayedNesterov needs a momentum in [0, 1)")

    @property
    def schedule(self) -> OuterSchedule:
        return OuterSchedule(self.lr_warmup, self.lr_decay, self.lr_min_ratio, self.momentum_warmup)

    def settings_at(self, k: int, steps: int) -> dict[str, float]:
        """The lr and momentum of outer step ``k`` of ``steps`` ({} without a schedule)."""
        schedule = self.schedule
        if not schedule.active:
            return {}
        return {"lr": schedule.lr(self.lr, k, steps), "momentum": schedule.momentum(self.momentum, k)}

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        kwargs: dict[str, Any] = {"lr": self.lr, **dict(self.kwargs)}
        if self.name == "DelayedNesterov":
            return DelayedNesterov(params, momentum=self.momentum, period=self.period, **kwargs)
        if self.name == "SGD":
            kwargs.setdefault("momentum", self.momentum)
            kwargs.setdefault("nesterov", self.nesterov and self.momentum > 0)
        return getattr(torch.optim, self.name)(params, **kwargs)


# An update longer than this many times θ (or 1, for a θ near 0) is absurd: no learning rate
# that trains moves the model that far in one outer step. Typical updates are ~1e-2 of θ.
ABSURD_UPDATE_RATIO = 100.0


@dataclass(frozen=True)
class NesterovStep:
    """One round's step when it is plain torch SGD with Nesterov momentum
    (``OuterOptimizer.nesterov_step``): its lr and momentum, and each stepped parameter's
    momentum buffer (None: none yet; torch's first step starts it as the gradient).
    ``averaging``: an averaging round instead (θ − mean Δ, the optimizer untouched)."""

    lr: float
    momentum: float
    buffers: dict[str, torch.Tensor | None]
    averaging: bool = False


class OuterStepRefused(ValueError):
    """The outer step would have made θ non-finite or absurd; θ and the optimizer state are
    as they were before it."""


Norm = Callable[[Mapping[str, torch.Tensor]], float]


def check_update(
    name: str,
    update: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor] | None = None,
    size: float | None = None,
    norm: Norm | None = None,
    params_norm: Callable[[], float] | None = None,
) -> float:
    """Raises OuterStepRefused if ``update`` is non-finite, or absurd against ``params``;
    returns its norm. ``size``: ``norm(update)`` when the caller has it already; ``norm``:
    the L2 norm to measure with (``l2`` unless given); ``params_norm``: |params| measured by
    the caller instead (when they are not in this process: a coordinator cut by range)."""
    norm = l2 if norm is None else norm
    size = norm(update) if size is None else size
    if not math.isfinite(size):
        raise OuterStepRefused(f"the {name} is not finite")
    # The limit is at least ABSURD_UPDATE_RATIO: below that, |θ| need not be measured.
    if (params is None and params_norm is None) or size <= ABSURD_UPDATE_RATIO:
        return size
    limit = ABSURD_UPDATE_RATIO * max(params_norm() if params_norm is not None else norm(params or {}), 1.0)
    if size > limit:
        raise OuterStepRefused(f"the {name} has norm {size:.4g}, over {ABSURD_UPDATE_RATIO:g} x max(|θ|, 1) = {limit:.4g}")
    return size


_L2_BLOCK = 1 << 16  # elements widened to float64 at a time: a buffer that stays in cache


def l2(tensors: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm over all tensors, in float64 (inf or nan when any value is).

    Block by block: each block of float32 values is widened into one small float64 buffer and
    dotted with itself, the blocks' sums added in order. One read of the values and no
    full-size float64 copy: about 6x faster than ``t.double().square_().sum()`` on one core
    (docs/measurements/coordinator.md), equal to it up to float64 rounding, and the same bits
    for the same tensors on one machine."""
    total = 0.0
    buf: torch.Tensor | None = None
    for t in tensors.values():
        flat = t.detach().reshape(-1)
        if flat.dtype == torch.float64:
            total += float(torch.dot(flat, flat)) if flat.numel() else 0.0
            continue
        for i in range(0, flat.numel(), _L2_BLOCK):
            block = flat[i : i + _L2_BLOCK]
            if buf is None:
                buf = torch.empty(_L2_BLOCK, dtype=torch.float64)
            wide = buf[: block.numel()].copy_(block)
            total += float(torch.dot(wide, wide))
    return math.sqrt(total)


def averaged_from(total_rounds: int, flush_rounds: int, final_average: bool, last: int = 1) -> int | None:
    """The first round the coordinator averages (θ − mean Δ, no outer step), or None: the
    flush rounds that end a streaming run (the last ``flush_rounds`` of ``total_rounds``), and
    with ``final_average`` the ``last`` rounds of training before them (blocking: the last round).

    A round averages when nothing trains after it. With flush rounds that is only the last
    fragment's last round of training: every other fragment trains on after its last round
    and its flush round (an average) ends it. Averaging those rounds too (the rule until
    2026-12-05) measured worse for streaming (docs/streaming.md). Under ``sync.end=freeze``
    each fragment stops at its last round: ``last`` = F, the last round of every fragment."""
    trained = total_rounds - flush_rounds
    if final_average:
        return max(0, trained - last)
    return trained if flush_rounds else None


@dataclass
class Tentative:
    """An outer step proposed and not yet settled (OuterOptimizer.propose)."""

    names: list[str]
    before: dict[str, torch.Tensor]  # θ_r of the stepped parameters
    saved: tuple[dict[torch.Tensor, dict[str, Any]], list[dict[str, Any]]]  # the optimizer state before
    proposed: dict[str, torch.Tensor]  # u
    sent: dict[str, torch.Tensor] = field(default_factory=dict)  # ũ: u as the downlink delivers it


class OuterOptimizer:
    """Owns θ (float32, name -> tensor) and the outer optimizer state.

    ``step(mean_delta, transmit)`` runs the optimizer to propose an update u = θ' − θ_r,
    passes it through ``transmit`` (encode and decode as the sites will receive it: ũ), and
    *defines* θ_{r+1} := θ_r + ũ (one float32 add), which is exactly what every site computes
    with the ũ it pulls. So the copies stay bit-identical even though θ_r + (θ' − θ_r) need not
    equal θ' in floats, and even when the downlink codec is lossy.

    A step is all or nothing: if the proposed update is non-finite or absurd
    (``check_update``), or ``transmit`` raises, θ and the optimizer state stay as they were
    and ``OuterStepRefused`` says why. ``update_norm`` is the norm of the last ũ applied.

    With a schedule (``cfg.schedule``), the step of round ``r`` takes the lr and momentum of
    outer step k = r // ``fragments`` of ``steps``: a pure function of the round, so a
    restored optimizer goes on with exactly the values it would have had.

    ``norm``: how the step measures updates and θ (``l2`` unless given; the coordinator's
    is diloco.coordinator.kernels.norm, which its blockwise commit reproduces).
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        cfg: OuterConfig,
        steps: int | None = None,
        fragments: int = 1,
        average_from: int | None = None,
        norm: Norm = l2,
    ) -> None:
        self.norm = norm
        self.names = sorted(params)
        self.params = {n: params[n].detach().clone().float() for n in self.names}
        self.cfg = cfg
        self._schedule = cfg.schedule
        if self._schedule.active and steps is None:
            raise ValueError("an outer schedule needs the run's number of outer steps")
        self.steps, self.fragments = steps, fragments
        # Rounds from this one on (streaming's flush rounds) average the sites' last partial
        # phases into θ (θ − mean Δ) without the outer step: no rate, no momentum, the
        # optimizer's state untouched. Each fragment has had its R outer steps, as blocking
        # DiLoCo's parameters have; a further momentum step would extrapolate it again.
        self.average_from = average_from
        self._opt = cfg.build([self.params[n] for n in self.names])
        self.update_norm = 0.0

    def hyperparameters(self, round: int) -> dict[str, float]:
        """The lr and momentum of round ``round``'s outer step ({} without a schedule)."""
        return self.cfg.settings_at(round // self.fragments, int(self.steps or 1))

    def step(
        self,
        mean_delta: Mapping[str, torch.Tensor],
        transmit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
        round: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """One outer step over the parameters ``mean_delta`` names (all of them, or one
        fragment's: the others, and their optimizer state, do not move); returns the update ũ
        that was applied (what the sites apply). ``transmit`` may return the proposed update
        itself (a lossless downlink): it is then not checked a second time. ``round``: the
        round this step commits, which places it on the schedule (needed with one)."""
        tentative = self.propose(mean_delta, round)
        try:
            size = check_update("proposed update", tentative.proposed, tentative.before, norm=self.norm)
            tentative.sent = transmit(tentative.proposed) if transmit is not None else tentative.proposed
            if tentative.sent is not tentative.proposed:
                size = check_update("update as sent", tentative.sent, tentative.before, norm=self.norm)
        except Exception as e:
            self.settle(tentative, accept=False)
            if isinstance(e, OuterStepRefused):
                raise
            raise OuterStepRefused(f"the outer step failed: {type(e).__name__}: {e}") from e
        self.settle(tentative, accept=True, size=size)
        return tentative.sent

    def propose(self, mean_delta: Mapping[str, torch.Tensor], round: int | None = None) -> Tentative:
        """The first half of ``step``: the optimizer's proposed update u, checked by nobody yet.
        θ and the optimizer state may hold the step's values until ``settle``, which must follow
        (a caller that judges u by more than this optimizer's parameters: a coordinator cut by
        parameter range, whose checks measure the whole model). ``tentative.sent``: set by the
        caller to the update as sent (``proposed`` unless the downlink changes it)."""
        if self._schedule.active and round is None:
            raise ValueError("an outer step with a schedule needs its round")
        names = [n for n in self.names if n in mean_delta]
        unknown = sorted(set(mean_delta) - set(self.names))
        if unknown or not names:
            raise OuterStepRefused(f"the outer step needs a Δ of this model's parameters; got {len(names)} known and unknown {unknown[:3]}")
        before = {n: self.params[n].clone() for n in names}
        tentative = Tentative(names, before, self._save_state(), {})
        try:
            if self.averages(round):
                proposed = {n: -mean_delta[n].detach().float() for n in names}
                for n in names:
                    self.params[n].add_(proposed[n])
            else:
                for group in self._opt.param_groups:
                    group.update(self.hyperparameters(int(round or 0)))
                for n in names:
                    self.params[n].grad = mean_delta[n].detach().clone()
                self._opt.step()  # parameters without a gradient are skipped, their state untouched
                proposed = {}
                for n in names:
                    p = self.params[n]
                    proposed[n] = p - before[n]
                    p.grad = None
        except Exception as e:
            self.settle(tentative, accept=False)
            raise OuterStepRefused(f"the outer step failed: {type(e).__name__}: {e}") from e
        tentative.proposed = tentative.sent = proposed
        return tentative

    def settle(self, tentative: Tentative, accept: bool, size: float = 0.0) -> None:
        """The second half of ``step``: θ_{r+1} := θ_r + ũ (``tentative.sent``), as the sites
        compute it, with ``size`` the norm of ũ; or, not accepted, θ and the optimizer state as
        they were before ``propose``."""
        if not accept:
            for n in tentative.names:
                self.params[n].grad = None
                self.params[n].copy_(tentative.before[n])
            self._load_state(tentative.saved)
            return
        for n in tentative.names:
            torch.add(tentative.before[n], tentative.sent[n], out=self.params[n])  # θ_{r+1} := θ_r + ũ
        self.update_norm = size

    def averages(self, round: int | None) -> bool:
        """Round ``round`` is an averaging round (θ − mean Δ, no outer step)."""
        return self.average_from is not None and round is not None and round >= self.average_from

    def nesterov_step(self, names: Iterable[str], round: int) -> NesterovStep | None:
        """Round ``round``'s step of ``names`` when it is torch's SGD with Nesterov momentum and
        nothing more (one group, no weight decay, dampening or maximize, no foreach, fused or
        differentiable flag, a number for lr, every momentum buffer a contiguous float32 tensor
        of its parameter's shape): its lr and momentum and the buffers; an averaging round
        (``averaging``: u = −mean Δ) for any optimizer; None otherwise (``step`` takes it). For a caller that computes exactly that
        step itself, in place (diloco.coordinator.commit_blocks), then calls ``stepped``."""
        opt = self._opt
        if self.averages(round):  # u = −mean Δ, whatever the optimizer (``step``'s averaging)
            return NesterovStep(1.0, 0.0, {n: None for n in names}, averaging=True)
        if type(opt) is not torch.optim.SGD or len(opt.param_groups) != 1:
            return None
        group = opt.param_groups[0]
        plain = {"nesterov": True, "weight_decay": 0, "dampening": 0, "maximize": False}
        if any(group.get(k) != v for k, v in plain.items()) or any(group.get(k) for k in ("foreach", "fused", "differentiable")):
            return None
        settings = {"lr": group["lr"], "momentum": group["momentum"], **self.hyperparameters(round)}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in settings.values()):
            return None
        buffers = {}
        for n in names:
            p = self.params[n]
            buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
            if buf is not None and not (
                torch.is_tensor(buf) and buf.dtype == torch.float32 and buf.is_contiguous() and buf.shape == p.shape and buf.device == p.device
            ):
                return None
            buffers[n] = buf
        return NesterovStep(float(settings["lr"]), float(settings["momentum"]), buffers)

    def stepped(self, round: int, step: NesterovStep, buffers: Mapping[str, torch.Tensor], size: float) -> None:
        """Records a step that ``nesterov_step`` described and its caller applied: θ and the
        momentum buffers written in place (``buffers``: every stepped parameter's, those made
        by this step included), ``size`` the norm of the update applied. The optimizer is then
        as torch's step would have left it: its group holds the round's lr and momentum, and a
        momentum of 0 leaves its state untouched."""
        if step.averaging:  # the optimizer's state and settings stay, as ``step``'s averaging leaves them
            self.update_norm = size
            return
        for group in self._opt.param_groups:
            group.update(self.hyperparameters(round))
        if step.momentum != 0:
            for n, buf in buffers.items():
                self._opt.state[self.params[n]]["momentum_buffer"] = buf
        self.update_norm = size

    def momentum_buffers(self) -> dict[str, torch.Tensor]:
        """Every parameter's momentum buffer (float32; views, read them under the caller's lock),
        zeros where the optimizer keeps none yet: torch's SGD starts a buffer as the gradient
        itself, so an absent buffer and a zero one give the same next step."""
        out = {}
        for n in self.names:
            buf = self._opt.state.get(self.params[n], {}).get("momentum_buffer")
            out[n] = buf if torch.is_tensor(buf) else torch.zeros_like(self.params[n])
        return out

    def _save_state(self) -> tuple[dict[torch.Tensor, dict[str, Any]], list[dict[str, Any]]]:
        """A copy of the optimizer's state (every parameter's, each tensor cloned) and of its
        groups' settings: what ``_load_state`` puts back if a step fails. (What a deepcopy of
        ``state_dict()`` held, without deepcopy's walk over every object.)"""
        state = {p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in s.items()} for p, s in self._opt.state.items()}
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in self._opt.param_groups]
        return state, groups

    def _load_state(self, saved: tuple[dict[torch.Tensor, dict[str, Any]], list[dict[str, Any]]]) -> None:
        state, groups = saved
        self._opt.state.clear()
        self._opt.state.update(state)
        for group, settings in zip(self._opt.param_groups, groups):
            group.update(settings)

    def state_dict(self, clone: bool = True) -> dict[str, Any]:
        """θ and the optimizer's state. ``clone=False``: θ by reference, as the optimizer's state
        always is (torch's ``state_dict`` does not copy it), for a caller that writes it out
        before the next step can move it (a coordinator's checkpoint)."""
        params = {n: p.clone() for n, p in self.params.items()} if clone else dict(self.params)
        return {"params": params, "optimizer": self._opt.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores θ and the optimizer state saved by ``state_dict`` (same names and shapes)."""
        params = state["params"]
        if sorted(params) != self.names:
            raise ValueError(f"saved outer state has parameters {sorted(params)[:5]}..., expected {self.names[:5]}...")
        with torch.no_grad():
            for n in self.names:
                if params[n].shape != self.params[n].shape:
                    raise ValueError(f"saved outer state: {n!r} has shape {list(params[n].shape)}, expected {list(self.params[n].shape)}")
                self.params[n].copy_(params[n])
        self._opt.load_state_dict(state["optimizer"])
