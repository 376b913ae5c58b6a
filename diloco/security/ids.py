"""What a site id may be: a short printable name, safe in file names, logs and certificates."""

from __future__ import annotations

import re

MAX_SITE_ID = 63
_SITE_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_SITE_ID - 1}}}")
SITE_ID_RULE = f"1-{MAX_SITE_ID} characters of A-Z a-z 0-9 _ . -, starting with a letter or digit"


def quote(value: object, limit: int = 64) -> str:
    """``repr`` of client input, cut to ``limit`` characters: error messages never echo
    unbounded input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def site_id_problem(site_id: object) -> str | None:
    """Why ``site_id`` is not a valid site id, or None."""
    if not isinstance(site_id, str) or not _SITE_ID.fullmatch(site_id):
        return f"site id {quote(site_id)} is not valid: a site id is {SITE_ID_RULE}"
    return None


def check_site_id(site_id: object) -> str:
    """``site_id`` if valid; ValueError naming the rule otherwise."""
    why = site_id_problem(site_id)
    if why is not None:
        raise ValueError(why)
    return site_id  # type: ignore[return-value]
