"""What the tests' site scripts (tests/*_ranks_site.py) share: where the coordinator is."""

from __future__ import annotations

import json
import os
import time


def coordinator_address(given: str | None, port_file: str | None) -> str:
    """``--coordinator``, or the address in the coordinator's ``--port-file`` once it exists
    (so the site starts importing while the coordinator starts)."""
    if given:
        return given
    if not port_file:
        raise SystemExit("--coordinator or --port-file is needed")
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if time.monotonic() > deadline:
            raise SystemExit(f"no coordinator port file at {port_file} after 60 s")
        time.sleep(0.1)
    with open(port_file) as f:
        where = json.load(f)
    return f"{where.get('host') or '127.0.0.1'}:{where['port']}"
