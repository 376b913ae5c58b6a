"""diloco-certs: creates a run's credentials (a run CA, the coordinator's certificate, a
certificate and token per site) and says which file goes to which machine."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from diloco.security.certs import not_valid_after
from diloco.security.store import DEFAULT_DAYS, RunCredentials, add_sites, write_run_credentials

EPILOG = """\
examples:
  diloco-certs --out creds --sites 4 --hosts coord.example.org 10.0.0.5
      a new run with sites 0 1 2 3 (a single integer N means the ids 0..N-1)
  diloco-certs --out creds --sites alpha beta --hosts localhost 127.0.0.1
      a new run with the sites alpha and beta
  diloco-certs --out creds --add-sites 4 5
      certificates and tokens for more sites, signed by the existing CA in creds/"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco-certs", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the run's credentials directory")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--sites", nargs="+", metavar="ID", help="a new run's site ids; a single integer N means 0..N-1")
    what.add_argument("--add-sites", nargs="+", metavar="ID", help="more sites for the run in --out (ids taken as given)")
    p.add_argument("--hosts", nargs="+", metavar="HOST", help="the coordinator's DNS names and IP addresses (with --sites)")
    p.add_argument("--days", type=float, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})")
    p.add_argument("--force", action="store_true", help="replace the credentials already in --out (every site needs its new files)")
    return p


def site_ids(values: list[str]) -> list[str]:
    """``values``, or 0..N-1 when it is the single plain integer N."""
    if len(values) == 1 and values[0].isdecimal() and values[0].isascii():
        return [str(i) for i in range(int(values[0]))]
    return values


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.sites is not None and not args.hosts:
        fail("--hosts is required with --sites: the coordinator's certificate names the hosts sites connect to")
    if args.add_sites is not None and (args.hosts or args.force):
        fail("--hosts and --force apply to a new run (--sites), not to --add-sites")
    try:
        if args.sites is not None:
            ids = site_ids(args.sites)
            creds = write_run_credentials(args.out, ids, args.hosts, days=args.days, force=args.force)
        else:
            ids = args.add_sites
            creds = add_sites(args.out, ids, days=args.days)
    except (ValueError, OSError) as e:
        fail(str(e))
    report(creds, ids, new_run=args.sites is not None)


def report(creds: RunCredentials, ids: list[str], new_run: bool) -> None:
    """Prints what was written and which files go to which machine."""
    expiry = not_valid_after(creds.site_pem(ids[0]).cert)
    print(f"wrote credentials for site(s) {' '.join(ids)} to {creds.dir} (valid until {expiry:%Y-%m-%d %H:%M} UTC)")
    if new_run:
        print(f"coordinator machine: {_paths(creds.files_for_coordinator())}")
    else:
        print(f"coordinator machine: {creds.tokens} (updated: copy it again)")
    for site_id in ids:
        print(f"site {site_id} machine: {_paths(creds.files_for_site(site_id))}")
    print(f"keep {creds.ca_key} on this machine only: it signs more sites (diloco-certs --out {creds.dir} --add-sites ID ...)")


def _paths(paths: tuple[Path, ...]) -> str:
    return " ".join(str(p) for p in paths)


def fail(message: str) -> NoReturn:
    """As diloco.cli.common.fail, which this CLI cannot import: that module loads hydra."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
