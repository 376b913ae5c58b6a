"""The data plane's way in for pseudo-gradients: each push's header checked against the run's
bounds, its chunks decoded outside the lock into a staging buffer from a bounded pool (memory
O(params × max_concurrent_pushes), never O(sites × params); a push that fails half-way leaves
nothing behind), the parts of a sharded site's push kept until its last, and the norm bound
(robust.norm_ratio) that judges each push against the recent ones. Takes no lock of its own:
the coordinator holds its lock around the calls that read or move shared state (``judge``,
``parts``), never around ``receive``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco.codec import CodecError
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.headers import HeaderBounds, header_problem
from diloco.coordinator.parts import PartialPushes
from diloco.coordinator.staging import StagingPool
from diloco.errors import CoordinatorError
from diloco.outer import NormBound, NormVerdict
from diloco.outer.robust import judged_size
from diloco.types import Chunk, PushHeader, TensorSpec
from diloco.wire import ChunkAssembler
from diloco.wire.held import HeldPush


@dataclass
class Received:
    """A push decoded into a staging buffer: its Δ (valid while the buffer is held), its payload
    bytes, its norm as the bound judges it, and how long it took."""

    delta: dict[str, torch.Tensor] | HeldPush
    payload_bytes: int
    size: float
    times: dict[str, float]


class Intake:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.bounds = HeaderBounds(total_rounds=cfg.total_rounds, max_tokens=cfg.max_tokens_per_push)
        self.staging = StagingPool(cfg.max_concurrent_pushes, cfg.staging_timeout_s, cfg.staging_stall_s)
        self.parts = PartialPushes()  # parts of sharded sites' pushes, until each site's last part
        self.bound = NormBound(cfg.robust)  # robust.norm_ratio: each push's Δ norm against recent ones
        self.refusals: dict[str, int] = {}  # site -> its pushes refused by the bound, over the run

    def check_header(self, header: PushHeader, what: str) -> None:
        why = header_problem(header, self.bounds)
        if why is not None:
            raise CoordinatorError("invalid_argument", f"{what} rejected: {why}")

    @property
    def fused(self) -> bool:
        """Whole pushes are kept as they came and added into the round's sum from their
        payloads (diloco.wire.held), with no float32 staging copy: where the sum is the plain
        weighted mean and no norm bound needs each push's values first."""
        return self.cfg.aggregate == "mean" and not self.cfg.robust.norm_ratio

    @contextlib.contextmanager
    def receive(
        self, header: PushHeader, chunks: Iterable[tuple[Chunk, torch.Tensor | None]], specs: Mapping[str, TensorSpec], check: Callable[[str], None],
        whole: bool = False,
    ) -> Iterator[Received]:  # fmt: skip
        """Decodes a whole push into a staging buffer, held while the block runs. ``chunks``:
        each with its values when they were decoded already (the parts of a sharded push);
        ``check``: refuses a tensor name the round does not sync. ``whole``: the chunks are a
        whole push's, none decoded yet: where the intake is ``fused`` they are only checked
        and kept (the staging buffer's slot bounds how many pushes are held at once).

        A buffer is taken only once the first chunk is here, and a site decodes one push at a
        time. While the push waits for its next chunk its buffer may go to a push that waits for
        one (staging.py: after ``staging_stall_s``); it is then refused (resource_exhausted)
        when that chunk, or the end of its stream, arrives."""
        t0, at = time.perf_counter(), time.monotonic()
        what = f"push of site {header.site_id!r} for round {header.round}"
        chunks = iter(chunks)
        try:
            first = next(chunks, None)
        except CodecError as e:  # a bundle that does not parse
            raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
        t_first = time.perf_counter()
        with self.staging.take(header.site_id) as lease:
            assembler: ChunkAssembler | HeldPush = HeldPush(specs) if whole and self.fused else ChunkAssembler(specs, out=lease.buffer)
            try:
                item = first
                while item is not None:
                    chunk, values = item
                    check(chunk.name)
                    if values is None:
                        assembler.add(chunk)
                    else:
                        assert isinstance(assembler, ChunkAssembler)
                        assembler.add(chunk, values)
                    with lease.idle():  # raises if the buffer went to another push meanwhile
                        item = next(chunks, None)
                delta = assembler.finish()
            except CodecError as e:
                raise CoordinatorError("invalid_argument", f"{what} rejected: {e}") from None
            received = time.perf_counter()
            times = {"began_at": at, "first_chunk_s": t_first - t0, "receive_s": received - t0, "received": received}
            size = 0.0 if isinstance(delta, HeldPush) else judged_size(delta, self.cfg.robust)
            yield Received(delta, assembler.payload_bytes, size, times)

    def judge(self, site_id: str, size: float) -> NormVerdict:
        """Under the lock: robust.norm_ratio's verdict on a push's Δ norm (a non-finite norm is
        always refused); the norm it is counted with joins the reference."""
        judged = self.bound.judge(size)
        if judged.taken_norm is not None:
            self.bound.record(judged.taken_norm)
        if judged.action == "reject":
            self.refusals[site_id] = self.refusals.get(site_id, 0) + 1
        return judged

    def checkpoint(self) -> dict[str, Any]:
        return {"robust_history": self.bound.history, "refusals": dict(self.refusals)}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.bound = NormBound(self.cfg.robust, [float(x) for x in state.get("robust_history", [])])
        self.refusals = {str(s): int(n) for s, n in state.get("refusals", {}).items()}
        self.parts.clear()
