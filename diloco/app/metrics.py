"""Turns committed rounds into metrics.jsonl lines, with the evaluation of θ: by the
coordinator on the held-out split (where it can build the model), or by the sites, each on
its own held-out data, reported with their next push or when they leave (token-weighted).

Runs in its own thread so evaluation overlaps the sites' next inner phase. A round's line is
written once its downlink traffic is complete (the next round committed, or every site left),
so bytes_down counts every pull of that round's update.

A coordinator that restarted from a checkpoint first repairs the file: it cuts a line torn by
the kill, and writes the lines of committed rounds its predecessor had not written yet (from
the records in the checkpoint, marked ``"recovered": true``; their eval_bpb and bytes_down
are unknown), so the rounds in metrics.jsonl stay consecutive, each exactly once.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from diloco.app.records import MetricsLine, append_metrics, metrics_rounds
from diloco.coordinator.service import Coordinator, RoundRecord


class MetricsReporter:
    def __init__(
        self,
        path: Path,
        coordinator: Coordinator,
        evaluate: Callable[[dict[str, torch.Tensor]], float] | None,
        log: Callable[[str], None] = print,
        *,
        eval_by: str = "coordinator",
        bytes_data: bool = True,
        on_fatal: Callable[[str, BaseException], None] | None = None,
        listeners: Sequence[Callable[[MetricsLine], None]] = (),
    ) -> None:
        """``evaluate``: θ -> held-out loss in nats per token (None: the sites evaluate);
        ``bytes_data``: tokens are bytes, so eval_bpb = eval_loss / ln 2 is written too;
        ``on_fatal``: told when the writer thread breaks (it never dies silently);
        ``listeners``: told every line once it is in the file (TensorBoard), those rewritten
        after a restart too; one that raises is logged and not told again (``on_line``)."""
        self._on_fatal = on_fatal
        self.on_line: list[Callable[[MetricsLine], None]] = list(listeners)
        self.path = path
        self._c = coordinator
        self._evaluate = evaluate
        self._eval_by = eval_by
        self._bytes = bytes_data
        self._log = log
        self._queue: queue.Queue[RoundRecord | None] = queue.Queue()
        self._closing = threading.Event()
        self.final_eval_loss: float | None = None
        self.final_eval_bpb: float | None = None
        self.lines = 0
        self.refused: dict[str, int] = {}  # site -> its pushes the norm bound refused (as the lines are written)
        self._recover()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def submit(self, record: RoundRecord) -> None:
        self._queue.put(record)

    def close(self, timeout_s: float = 600.0) -> None:
        """Writes every pending line (evaluating where due), then stops the thread."""
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def set_final(self, eval_loss: float) -> None:
        self.final_eval_loss = eval_loss
        self.final_eval_bpb = self._bpb(eval_loss)

    def _bpb(self, loss: float | None) -> float | None:
        return loss / math.log(2) if loss is not None and self._bytes else None

    def _run(self) -> None:
        try:
            self._write_lines()
        except BaseException as e:  # noqa: BLE001 - a dead writer must never go unnoticed
            if self._on_fatal is None:
                raise
            self._on_fatal("the metrics writer", e)

    def _write_lines(self) -> None:
        while (record := self._queue.get()) is not None:
            eval_loss = self._evaluate(record.params) if self._evaluate is not None and record.params is not None else None
            record.params = None  # drop the snapshot as soon as it has been used
            while not self._closing.is_set() and not self._c.round_settled(record.round):
                self._closing.wait(0.05)
            # The sites' evaluations of this round came with their next pushes (or as they left).
            by_sites = self._c.site_eval(record.round) if self._evaluate is None else None
            if by_sites is not None:
                eval_loss = by_sites["loss"]
            if eval_loss is not None and record.round + 1 == self._c.cfg.total_rounds:
                self.set_final(eval_loss)
            line = self._line(record.summary(), eval_loss=eval_loss, bytes_down=self._c.bytes_down(record.round))
            if by_sites is not None:
                line.eval_sites = by_sites["sites"]
                line.eval_tokens = by_sites["tokens"]
            append_metrics(self.path, line)
            self.lines += 1
            self._tell(line)
            eval_bpb = line.eval_bpb
            shown = f"{eval_bpb:.4f}" if eval_bpb is not None else f"{eval_loss:.4f} nats/token" if eval_loss is not None else "-"
            verdict = f" REJECTED: {record.guard}" if record.rejected else ""
            for r in record.refused:
                verdict += f"; push of site {r['site']} not counted: {r['why']}"
            for r in record.clipped:
                verdict += f"; push of site {r['site']} clipped: {r['why']}"
            for r in record.withheld:
                verdict += f"; site {r['site']} withheld its push: {r['why']}"
            self._log(f"round {record.round} committed: sites={','.join(record.participants)} tokens={record.tokens} eval_bpb={shown}{verdict}")
            for r in record.refused:
                self.refused[r["site"]] = self.refused.get(r["site"], 0) + 1
                if self.refused[r["site"]] >= 2:
                    self._log(f"site {r['site']}: {self.refused[r['site']]} of its pushes refused so far (robust.norm_ratio); it may be broken or hostile")

    def _tell(self, line: MetricsLine) -> None:
        """The line to each listener; a listener that breaks is dropped (training goes on)."""
        for listener in list(self.on_line):
            try:
                listener(line)
            except Exception as e:  # noqa: BLE001 - a dashboard must not stop the run
                self.on_line.remove(listener)
                self._log(f"metrics: a line listener failed and is dropped: {type(e).__name__}: {e}")

    def _line(self, rec: dict, *, eval_loss: float | None, bytes_down: int | None, recovered: bool = False) -> MetricsLine:
        return MetricsLine(
            round=rec["round"],
            participants=rec["participants"],
            absent=rec["absent"],
            evicted=rec["evicted"],
            late=self._c.late_pushes(rec["round"]),
            merged=rec.get("merged", []),
            sliced=rec.get("sliced") or None,
            rejected=rec["rejected"],
            guard=rec["guard"],
            tokens=rec["tokens"],
            inner_steps=rec["inner_steps"],
            bytes_up=rec["bytes_up"],
            bytes_down=bytes_down,
            train_loss=rec["train_loss"],
            eval_loss=eval_loss,
            eval_bpb=self._bpb(eval_loss),
            eval_by=self._eval_by if eval_loss is not None else None,
            update_norm=rec["update_norm"],
            delta_norm=rec["delta_norm"],
            global_sha256=rec["global_sha256"],
            wall_s=round(rec["wall_s"], 4),
            elapsed_s=round(rec["elapsed_s"], 4),
            recovered=True if recovered else None,
            refused=rec.get("refused") or None,
            clipped=rec.get("clipped") or None,
            withheld=rec.get("withheld") or None,
            fragment=rec.get("fragment") if self._c.cfg.fragments > 1 else None,
        )

    def _recover(self) -> None:
        """Cuts a torn last line and writes the committed rounds' missing lines (see above)."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
        written = metrics_rounds(self.path)
        last = max(written, default=-1)
        records = self._c.recent_records()
        for r in range(last + 1, self._c.committed_rounds):
            rec = records.get(r)
            if rec is None:
                self._log(f"metrics: round {r} was committed before the restart but its record is gone; its line is missing")
                continue
            line = self._line(rec, eval_loss=None, bytes_down=None, recovered=True)
            append_metrics(self.path, line)
            self.lines += 1
            self._tell(line)
            self._log(f"metrics: wrote the line of round {r}, committed before the restart")
