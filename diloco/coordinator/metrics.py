"""Turns committed rounds into metrics.jsonl lines, evaluating θ on the held-out split.

Runs in its own thread so evaluation overlaps the sites' next inner phase. A round's line is
written once its downlink traffic is complete (the next round committed, or every site left),
so bytes_down counts every pull of that round's update.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from diloco.coordinator.service import Coordinator, RoundRecord
from diloco.io import append_jsonl


class MetricsReporter:
    def __init__(
        self,
        path: Path,
        coordinator: Coordinator,
        evaluate: Callable[[dict[str, torch.Tensor]], float],
        log: Callable[[str], None] = print,
    ) -> None:
        self.path = path
        self._c = coordinator
        self._evaluate = evaluate
        self._log = log
        self._queue: queue.Queue[RoundRecord | None] = queue.Queue()
        self._closing = threading.Event()
        self.final_eval_bpb: float | None = None
        self.lines = 0
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def submit(self, record: RoundRecord) -> None:
        self._queue.put(record)

    def close(self, timeout_s: float = 600.0) -> None:
        """Writes every pending line (evaluating where due), then stops the thread."""
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (record := self._queue.get()) is not None:
            eval_bpb = self._evaluate(record.params) if record.params is not None else None
            record.params = None  # drop the snapshot as soon as it has been used
            if eval_bpb is not None and record.round + 1 == self._c.cfg.total_rounds:
                self.final_eval_bpb = eval_bpb
            while not self._closing.is_set() and not self._c.round_settled(record.round):
                self._closing.wait(0.05)
            line = {
                "round": record.round,
                "participants": record.participants,
                "tokens": record.tokens,
                "inner_steps": record.inner_steps,
                "bytes_up": record.bytes_up,
                "bytes_down": self._c.bytes_down(record.round),
                "train_loss": record.train_loss,
                "eval_bpb": eval_bpb,
                "update_norm": record.update_norm,
                "global_sha256": record.global_sha256,
                "wall_s": round(record.wall_s, 4),
                "elapsed_s": round(record.elapsed_s, 4),
            }
            append_jsonl(self.path, line)
            self.lines += 1
            shown = f"{eval_bpb:.4f}" if eval_bpb is not None else "-"
            self._log(f"round {record.round} committed: sites={','.join(record.participants)} tokens={record.tokens} eval_bpb={shown}")
