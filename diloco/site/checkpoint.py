"""A site's own checkpoint: what it needs, beyond the global θ it pulls from the coordinator,
to go on after a crash or a stop as if nothing had happened.

Written after every round the site completes (atomically, checksummed: diloco.checkpoint),
for the round it is about to train: the inner optimizer state (AdamW moments), the inner
step count, the data sampler's position, the uplink error-feedback residual, the tokens it
trained, and the hash of the global θ it holds. A site that starts again with the same id
joins, pulls θ whole and then restores:

* the inner optimizer state always (moments a few rounds old beat zeros);
* the sampler position and the residual only if the checkpoint is for the round the site
  joins at (nothing was committed since): the residual's content was partly sent in any
  later committed round, so applying it again would count that part twice; the sampler
  then skips to the open round instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.checkpoint import CheckpointError, load_latest, save_checkpoint
from diloco.data import ShardSampler
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

    def save(self, *, round: int, global_sha256: str, residual: dict[str, torch.Tensor] | None, tokens: int) -> Path:
        """The checkpoint for ``round``, the round the site is about to train."""
        state = {
            "run_id": self.run_id,
            "round": round,
            "global_sha256": global_sha256,
            "optimizer": self.trainer.optimizer.state_dict(),
            "steps_done": self.trainer.steps_done,
            "sampler": self.sampler.state_dict(),
            "residual": residual,
            "tokens": tokens,
        }
        return save_checkpoint(self.directory, round, state)

    def restore(self, *, round: int, global_sha256: str, set_residual: Callable[[dict[str, torch.Tensor] | None], None]) -> Restored | None:
        """Loads the newest good checkpoint of this run into the trainer, sampler and residual
        (see the module's rules) for a site that joined at ``round`` holding θ with hash
        ``global_sha256``; None when there is none (the site starts fresh)."""
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
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        exact = int(state["round"]) == round
        if exact:
            self.sampler.load_state_dict(state["sampler"])
            set_residual(state["residual"])
            self.trainer.steps_done = int(state["steps_done"])
        return Restored(round=int(state["round"]), exact=exact, hash_matches=state["global_sha256"] == global_sha256, tokens=int(state["tokens"]))
