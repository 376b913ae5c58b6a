"""What the tests' site scripts (tests/*_ranks_site.py) share: their common arguments and where
the coordinator is."""

from __future__ import annotations

import argparse
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


def site_parser() -> argparse.ArgumentParser:
    """The arguments every site script takes; each adds its own."""
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", help="HOST:PORT")
    p.add_argument("--port-file", help="else: the coordinator's port file, waited for")
    p.add_argument("--site-id", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sync-every", type=int, default=3)
    p.add_argument("--out", required=True)
    return p
