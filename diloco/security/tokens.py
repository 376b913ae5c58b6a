"""Per-site bearer tokens and the coordinator's table of their hashes (tokens.json).

A site presents its token; the coordinator stores only ``sha256(token)`` per site. A token is
32 random bytes, so a plain (unsalted, fast) hash is the right stored form: nothing can guess
a preimage, and a leaked table grants nothing. A salted slow hash is for guessable passwords."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path

from diloco.security.ids import quote, site_id_problem

TABLE_VERSION = 1
TABLE_HASH = "sha256"
_HEX = re.compile(r"[0-9a-f]{64}")


def new_token() -> str:
    """A fresh token: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """The stored form of a token: the hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """Which site each token hash belongs to. Immutable; ``with_tokens`` makes a larger one."""

    def __init__(self, hashes: Mapping[str, str]) -> None:
        """``hashes``: {site_id: token_hash(token)}. ValueError names the first bad entry."""
        for site_id, digest in hashes.items():
            why = site_id_problem(site_id)
            if why is not None:
                raise ValueError(why)
            if not isinstance(digest, str) or not _HEX.fullmatch(digest):
                raise ValueError(f"site {site_id!r}: hash {quote(digest)} is not 64 lowercase hex digits")
        if len(set(hashes.values())) != len(hashes):
            raise ValueError("two sites have the same token hash: each site needs its own token")
        self._hashes = dict(hashes)

    @property
    def sites(self) -> frozenset[str]:
        return frozenset(self._hashes)

    def site_of(self, token: str) -> str | None:
        """The site whose token this is, or None. Compares the token's hash with every stored
        hash in constant time and never stops early: the time depends on the table's size only."""
        presented = token_hash(token).encode()
        found = None
        for site_id, digest in self._hashes.items():
            if hmac.compare_digest(presented, digest.encode()):
                found = site_id
        return found

    def with_tokens(self, tokens: Mapping[str, str]) -> TokenTable:
        """This table plus {site_id: token} for new sites; ValueError for a site already here."""
        taken = sorted(set(tokens) & set(self._hashes))
        if taken:
            raise ValueError(f"site(s) {', '.join(taken)} already have a token")
        return TokenTable({**self._hashes, **{s: token_hash(t) for s, t in tokens.items()}})

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        """The table a tokens.json holds; ValueError naming ``path`` and the problem."""
        try:
            data = json.loads(Path(path).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a JSON token table ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("sites"), dict):
            raise ValueError(f"{path}: not a token table (expected an object with a 'sites' object)")
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"{path}: token table version {quote(data.get('version'))} is not {TABLE_VERSION}")
        if data.get("hash") != TABLE_HASH:
            raise ValueError(f"{path}: token hash {quote(data.get('hash'))} is not {TABLE_HASH!r}")
        try:
            return cls(data["sites"])
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path: Path) -> None:
        """Writes the table as tokens.json, atomically, mode 0600."""
        data = {"version": TABLE_VERSION, "hash": TABLE_HASH, "sites": dict(sorted(self._hashes.items()))}
        write_atomic(Path(path), (json.dumps(data, indent=2) + "\n").encode(), mode=0o600)


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Writes ``data`` to a new temp file beside ``path`` (created 0600), fsyncs, sets ``mode``,
    renames: a reader sees the old file or the new one, and others never see a key's bytes."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
