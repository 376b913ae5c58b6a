"""What a site made by ``DiLoCo(...)`` or a trainer plug-in is given, checked: its arguments
(each refused by name), the settings it states at Join, and whether it can serve the run's."""

from __future__ import annotations

import dataclasses
import operator

from diloco.codec import CodecConfig, codec_config
from diloco.sync import RunSettings


class RunNotServed(RuntimeError):
    """Raised by ``join`` for a run whose settings this object cannot follow (see
    ``served_problem``); the message names the setting."""


def served_problem(settings: RunSettings) -> str | None:
    """Why the step-hook API cannot serve a run with ``settings``, or None: it runs blocking
    rounds of the whole model (any H, sync.schedule, every codec and outer step); streaming
    fragments, overlap, eager/delayed phases and time budgets need diloco-site's round loop."""
    sync = settings.sync
    for key, value, plain in (
        ("sync.fragments", sync.fragments, 1),
        ("sync.overlap", sync.overlap, 0),
        ("sync.mode", str(sync.mode), "blocking"),
        ("sync.budget_s", sync.budget_s, None),
    ):
        if value != plain:
            return f"this run has {key}={value}: DiLoCo(...) and the trainer plug-ins run blocking rounds of the whole model ({key}={plain}); run this site with diloco-site"
    return None


def stated_settings(
    *, sync_every: int | None, codec: CodecConfig | str | None, error_feedback: bool | None, error_feedback_decay: float | None
) -> tuple[RunSettings, tuple[str, ...]]:
    """The site's own settings (the defaults with what is given) and the keys given (stated)."""
    base = RunSettings.defaults()
    given: dict[str, object] = {}
    if sync_every is not None:
        given["sync"] = dataclasses.replace(base.sync, every=sync_every)
    if codec is not None:
        given["codec"] = codec_config(codec)
    if error_feedback is not None:
        given["error_feedback"] = error_feedback
    if error_feedback_decay is not None:
        given["error_feedback_decay"] = float(error_feedback_decay)
    keys = {"sync": "sync.every", "codec": "codec", "error_feedback": "error_feedback", "error_feedback_decay": "error_feedback_decay"}
    return dataclasses.replace(base, **given), tuple(keys[k] for k in given)  # type: ignore[arg-type]


def check_site_args(site_id: object, sync_every: object, tokens_per_step: object = 1) -> None:
    """Raises ValueError, naming the argument, for an empty ``site_id``, a ``sync_every``
    below 1 (``None``: the run's) or a ``tokens_per_step`` below 1 (``None`` is allowed for
    tokens_per_step: the plug-ins then count tokens themselves)."""
    if site_id is None or not str(site_id).strip():
        raise ValueError(f"site_id={site_id!r}: must be a non-empty string")
    if sync_every is not None and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
        raise ValueError(f"sync_every={sync_every!r}: must be None (the run's) or >= 1")
    if tokens_per_step is not None and (isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1):
        raise ValueError(f"tokens_per_step={tokens_per_step!r}: must be >= 1")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_sync_args(error_feedback: object = None, error_feedback_decay: object = None, round_timeout_s: object = 3600.0) -> None:
    """Raises ValueError, naming the argument, for an ``error_feedback`` that is not a bool
    (or None: the run's), an ``error_feedback_decay`` outside [0, 1] or a ``round_timeout_s``
    that is not > 0 (``math.inf``: wait for ever)."""
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback={error_feedback!r}: must be None (the run's), True or False")
    if error_feedback_decay is not None and not (_is_number(error_feedback_decay) and 0.0 <= error_feedback_decay <= 1.0):  # type: ignore[operator]
        raise ValueError(f"error_feedback_decay={error_feedback_decay!r}: must be None (the run's) or a number in [0, 1]")
    if not (_is_number(round_timeout_s) and round_timeout_s > 0):  # type: ignore[operator]  (NaN fails too)
        raise ValueError(f"round_timeout_s={round_timeout_s!r}: must be a number of seconds > 0")


def check_tokens(n: object, name: str = "tokens") -> int:
    """``n`` as an int, or ValueError naming ``name`` unless it is an integer >= 0 (a Python
    or NumPy int, or a one-element integer tensor; not a bool or a float)."""
    if not isinstance(n, bool):
        try:
            value = operator.index(n)  # type: ignore[arg-type]
        except (TypeError, RuntimeError, ValueError):
            pass
        else:
            if value >= 0:
                return value
    raise ValueError(f"{name}={n!r}: must be an integer >= 0")
