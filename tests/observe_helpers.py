"""Reading back what a run shows, with the tools made for it: a /metrics scrape parsed by
prometheus_client's own parser, TensorBoard event files read by tensorboard's own
EventAccumulator, the health service asked through grpc_health's stub."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path
from typing import Any

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(url: str) -> Samples:
    """sample name -> {sorted label pairs -> value}, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers.get("Content-Type", "").startswith("text/plain")
        text = reply.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The value of ``name`` with exactly ``labels`` (KeyError naming what is there if absent)."""
    series = samples[name]
    key = tuple(sorted(labels.items()))
    if key not in series:
        raise KeyError(f"{name}{labels}: not among {sorted(series)}")
    return series[key]


def tb_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] of every scalar in ``directory``'s event files, all of them."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def health_status(channel: Any, service: str = "") -> str:
    """SERVING / NOT_SERVING / ... as grpc_health's stub gets it from ``channel``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class HandSite:
    """A site that syncs without training (its model nudged each round), one round each time
    the test opens the round's gate (``round(r)``, then ``wait(r)``); it leaves when told
    (``leave.set()``). Its train loss for round r is ``loss0 - r / 10``."""

    def __init__(self, site_id: str, address: str, cfg: Any, rounds: int, loss0: float = 2.0) -> None:
        self.site_id, self.address, self.cfg, self.loss0 = site_id, address, cfg, loss0
        self.gates = [threading.Event() for _ in range(rounds)]
        self.done = [threading.Event() for _ in range(rounds)]
        self.leave = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"site-{site_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import torch

        from diloco.model import build_model
        from diloco.site.outer_sync import OuterSync, SyncOptions
        from diloco.transport import CoordinatorClient

        try:
            model = build_model(self.cfg.model, self.cfg.seed)
            with CoordinatorClient(self.address, timeout_s=30, connect_timeout_s=30) as client:
                sync = OuterSync(model, client, self.site_id, SyncOptions.of(every=self.cfg.sync.every))
                sync.join()
                for r, gate in enumerate(self.gates):
                    gate.wait()
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(0.001 * (1 + int(self.site_id)))
                    sync.sync(tokens=100 * (r + 1), train_loss=self.loss0 - r / 10, inner_steps=1)
                    self.done[r].set()
                self.leave.wait()
                sync.leave()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            for event in self.done:
                event.set()

    def round(self, r: int) -> None:
        self.gates[r].set()

    def wait(self, r: int) -> None:
        self.done[r].wait()
        assert self.error is None, self.error

    def release(self) -> None:
        """Lets the thread run to its end, whatever round it waits for (teardown)."""
        self.leave.set()
        for gate in self.gates:
            gate.set()
