"""A site's own checkpoint: what it needs, beyond the global θ it pulls from the coordinator,
to go on after a crash or a stop as if nothing had happened.

Written after every round the site completes (with fragments, after every F-th: a whole cycle
of them; atomically, checksummed: diloco.checkpoint), for the round it is about to train: the inner optimizer state (AdamW moments), the inner
step count, the data sampler's position, the uplink error-feedback residual, the tokens it
trained, and the hash of the global θ it holds. The training thread only copies that state
to the host; a writer thread puts it on disk while the next inner steps run (one write at a
time: a save waits for the write before it, and ``close`` for the last). A site that starts again with the same id
joins, pulls θ whole and then restores:

* the inner optimizer state always (moments a few rounds old beat zeros);
* the sampler position and the residual only if the checkpoint is for the round the site
  joins at (nothing was committed since): the residual's content was partly sent in any
  later committed round, so applying it again would count that part twice; the sampler
  then skips to the open round instead.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco.checkpoint import CheckpointError, load_latest, save_checkpoint
from diloco.data import ShardSampler
from diloco.security.ids import quote
from diloco.site.inner import InnerTrainer


@dataclass(frozen=True)
class Restored:
    round: int  # the round the checkpoint was written for
    exact: bool  # for the round the site joined at: everything came back
    hash_matches: bool  # the θ the site pulled hashes to what the checkpoint recorded
    tokens: int


@dataclass
class SiteCheckpointer:
    """Writes and restores the checkpoints of one site of one run in ``directory``."""

    directory: Path
    run_id: str
    trainer: InnerTrainer
    sampler: ShardSampler
    log: Callable[[str], None] = print

    background: bool = True  # write on a thread of its own (False: save returns once it is on disk)
    _writer: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _pending: Future[Path] | None = field(default=None, init=False, repr=False)

    def save(self, *, round: int, global_sha256: str, residual: dict[str, torch.Tensor] | None, tokens: int) -> Future[Path]:
        """The checkpoint for ``round``, the round the site is about to train: its state copied
        now, written in the background (or at once: ``background`` False); the future ends
        when the file is on disk, with its path."""
        self.wait()  # the write before it is on disk (or its error raised) first
        state = _host_copy({
            "run_id": self.run_id,
            "round": round,
            "global_sha256": global_sha256,
            "optimizer": self.trainer.optimizer.state_dict(),
            "steps_done": self.trainer.steps_done,
            "sampler": self.sampler.state_dict(),
            "residual": residual,
            "tokens": tokens,
        })  # fmt: skip
        if not self.background:
            done: Future[Path] = Future()
            done.set_result(save_checkpoint(self.directory, round, state))
            return done
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="site-checkpoint")
        self._pending = self._writer.submit(save_checkpoint, self.directory, round, state)
        return self._pending

    def wait(self) -> None:
        """Returns once the write in flight (if any) is on disk; raises what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Waits for the last write and stops the writer thread."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    def restore(self, *, round: int, global_sha256: str, set_residual: Callable[[dict[str, torch.Tensor] | None], None]) -> Restored | None:
        """Loads the newest good checkpoint of this run into the trainer, sampler and residual
        (see the module's rules) for a site that joined at ``round`` holding θ with hash
        ``global_sha256``; None when there is none, or none usable (logged, naming the file:
        the site starts fresh, nothing restored). CheckpointError naming the file when its
        sampler state is another shard's (the optimizer state is restored by then)."""
        self.wait()
        try:
            loaded = load_latest(self.directory)
        except CheckpointError as e:
            self.log(f"no usable site checkpoint ({e}); the inner optimizer starts fresh")
            return None
        if loaded is None:
            return None
        for problem in loaded.problems:
            self.log(f"skipping a bad site checkpoint: {problem}")
        state: dict[str, Any] = loaded.state
        if state.get("run_id") != self.run_id:
            self.log(f"site checkpoint {loaded.path} is of run {state.get('run_id')}, not {self.run_id}: ignored")
            return None
        why = _state_problem(state)
        if why is None:
            try:  # before anything else changes: a state that does not load leaves the site fresh
                self.trainer.optimizer.load_state_dict(state["optimizer"])
            except (AttributeError, KeyError, RuntimeError, TypeError, ValueError) as e:
                why = f"its optimizer state does not fit this model ({quote(str(e), 200)})"
        if why is not None:
            self.log(f"site checkpoint {loaded.path} is not usable: {why}; the inner optimizer starts fresh")
            return None
        exact = state["round"] == round
        if exact:
            try:
                self.sampler.load_state_dict(state["sampler"])
            except (AttributeError, KeyError, RuntimeError, TypeError, ValueError) as e:
                raise CheckpointError(f"{loaded.path}: its sampler state does not fit this site: {e}") from None
            set_residual(state["residual"])
            self.trainer.steps_done = state["steps_done"]
        return Restored(round=state["round"], exact=exact, hash_matches=state["global_sha256"] == global_sha256, tokens=state["tokens"])


def _host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory: what training goes on to change (the
    optimizer's moments, in place) cannot reach the state being written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return obj


# What ``save`` writes, by type: a checksummed file of this run with anything else was
# written by something else, and is not applied.
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "round": int, "global_sha256": str, "optimizer": dict, "steps_done": int, "sampler": dict, "residual": (dict, type(None)), "tokens": int,
}  # fmt: skip


def _state_problem(state: dict[str, Any]) -> str | None:
    """Why ``state`` is not what ``SiteCheckpointer.save`` writes (None: it is)."""
    for key, kind in _FIELDS.items():
        if key not in state:
            return f"it has no {key!r}"
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            return f"its {key!r} is a {type(state[key]).__name__}"
    return None
