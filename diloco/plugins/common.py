"""What the trainer plug-ins share: the site's settings and joining the run with them."""

from __future__ import annotations

from typing import Any

from torch import nn

from diloco.api import DiLoCo
from diloco.codec import CodecConfig
from diloco.security.config import SecurityConfig
from diloco.site.arguments import check_site_args, check_sync_args
from diloco.site.layouts.base import see_through


class SiteSettings:
    """The arguments every plug-in takes (see its class docstring), checked when given.

    ``sync_every``, ``codec``, ``error_feedback`` and ``error_feedback_decay`` are the run's
    settings as for ``diloco.DiLoCo``: None takes the coordinator's, a value is stated at Join
    (a run with another one refuses the site); ``round_timeout_s`` is the site's own.
    """

    def __init__(
        self,
        coordinator: str,
        site_id: str,
        sync_every: int | None = None,
        codec: CodecConfig | str | None = None,
        tokens_per_step: int | None = None,
        *,
        error_feedback: bool | None = None,
        error_feedback_decay: float | None = None,
        round_timeout_s: float = 3600.0,
        connect_timeout_s: float = 120.0,
        security: SecurityConfig | None = None,
        process_group: Any = None,
    ) -> None:
        check_site_args(site_id, sync_every, tokens_per_step)
        check_sync_args(error_feedback, error_feedback_decay, round_timeout_s)
        self.coordinator = coordinator
        self.site_id = str(site_id)
        self.sync_every = sync_every
        self.codec = codec
        self.tokens_per_step = tokens_per_step  # None: the plug-in counts the tokens of each step
        self.error_feedback = error_feedback
        self.error_feedback_decay = error_feedback_decay
        self.round_timeout_s = round_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.security = security
        self.process_group = process_group

    def join(self, model: nn.Module) -> DiLoCo:
        """Joins the run as this site and loads the global θ into ``model`` (in place). On a
        multi-rank site every rank calls it (collective): ``model`` is the rank's module as the
        trainer runs it or the module inside: wrappers that only rename the parameters (DDP,
        DataParallel, ``torch.compile``) are seen through, also in one process, so the synced
        names are the user's module's; FSDP2 and tensor-parallel parameters are synced as the
        slices the rank holds; FSDP1's flat parameters are refused, naming one)."""
        site = DiLoCo(
            see_through(model), None, coordinator=self.coordinator, site_id=self.site_id, sync_every=self.sync_every,
            tokens_per_step=self.tokens_per_step or 1, codec=self.codec, error_feedback=self.error_feedback,
            error_feedback_decay=self.error_feedback_decay, round_timeout_s=self.round_timeout_s,
            connect_timeout_s=self.connect_timeout_s, security=self.security,
            process_group=self.process_group,
        )  # fmt: skip
        site.join()  # closes the connection again if it fails
        return site
