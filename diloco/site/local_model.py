"""The parameters a site's rank holds, as the outer sync reads and writes them: host views
of their values, copies, and loading values back (then the layout's own after-pull hook)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from diloco.site.host_copy import HostMirror
from diloco.site.layouts.base import ParallelModel


class LocalModel:
    def __init__(self, layout: ParallelModel) -> None:
        self.layout = layout
        self._host = HostMirror()
        self.on_device = HostMirror.on_device(self.tensors())

    def tensors(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """This rank's parameters (``names``: only those it holds of them), where they train."""
        held = self.layout.held()
        if names is None:
            return {n: h.tensor for n, h in held.items()}
        wanted = set(names)
        return {n: h.tensor for n, h in held.items() if n in wanted}

    def values(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Their values on the host (the tensors themselves on a CPU site: not copies)."""
        return self._host.host(self.tensors(names))

    def copy(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Detached host copies of their values (float32)."""
        return {n: t.detach().float().clone() for n, t in self.values(names).items()}

    def load(self, values: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> None:
        """The parameters (``names``: only those) ← ``values``."""
        HostMirror.load(self.tensors(names), values)
        self.layout.after_pull()
