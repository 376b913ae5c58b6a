"""diloco-site: one site of a real multi-site run, pointed at a coordinator by config."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from diloco.app.config import ConfigError
from diloco.app.site import SiteOptions, run_site
from diloco.cli.common import SECTIONS, check_renamed, fail, process_metrics, process_progress, run_config, run_dir, section, stated_overrides
from diloco.data import DataError
from diloco.io import exit_process
from diloco.observe.logs import setup_logging
from diloco.site.device import flush_denormals
from diloco.transport import RemoteError


@hydra.main(config_path="pkg://diloco.conf", config_name="site", version_base=None)
def _main(cfg: DictConfig) -> None:
    try:
        rc = run_config(cfg, SECTIONS["site"])
        flush_denormals(rc.inner.flush_denormal)  # the process's setting, before its threads start
        s = section(cfg, "site")
        opts = SiteOptions(
            site_id=str(s["id"]), coordinator=s["coordinator"], shard=s["shard"], connect_timeout_s=float(s["connect_timeout_s"]), checkpoint_dir=s["checkpoint_dir"],
            metrics=process_metrics(cfg), progress=process_progress(cfg), stated=stated_overrides(),
        )  # fmt: skip
        opts.data_shard(rc.sites)
        run_site(rc, opts, run_dir(), log=setup_logging(f"site {opts.site_id}", json=rc.logging.json))
        exit_process()  # written and done: skip the interpreter's teardown (seconds; see exit_process)
    except DataError as e:
        fail(f"bad data: {e}")
    except (ConfigError, ValueError) as e:
        fail(f"bad config: {e}")
    except FileNotFoundError as e:
        fail(f"bad setup: {e}")
    except RemoteError as e:
        fail(f"the coordinator refused this site: {e}", code=1)


def main() -> None:
    check_renamed(sys.argv[1:])  # before hydra, which would only say the key is unknown
    _main()


if __name__ == "__main__":
    main()
