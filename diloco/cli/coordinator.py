"""diloco-coordinator: the coordinator of a real multi-site run."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from diloco.app.config import ConfigError
from diloco.app.coordinator import CoordinatorFailed, CoordinatorOptions, run_coordinator
from diloco.app.preset import apply_preset
from diloco.checkpoint import CheckpointError
from diloco.cli.common import SECTIONS, check_renamed, fail, process_metrics, process_status, run_config, run_dir, section
from diloco.coordinator.init_file import InitFileError
from diloco.data import DataError
from diloco.io import exit_process
from diloco.observe.logs import setup_logging
from diloco.site.device import flush_denormals


@hydra.main(config_path="pkg://diloco.conf", config_name="coordinator", version_base=None)
def _main(cfg: DictConfig) -> None:
    try:
        rc = run_config(cfg, SECTIONS["coordinator"])
        flush_denormals(rc.inner.flush_denormal)  # the process's setting, before its threads start
        opts = CoordinatorOptions(**section(cfg, "coordinator"), metrics=process_metrics(cfg), status=process_status(cfg))
        log = setup_logging("coordinator", json=rc.logging.json)
        try:
            rc = apply_preset(rc, measure=False, log=log)  # the settings the coordinator hands out (sync.preset)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        run_coordinator(rc, opts, run_dir(), log=log)
        exit_process()  # written and done: skip the interpreter's teardown (seconds; see exit_process)
    except (ConfigError, TypeError) as e:
        fail(f"bad config: {e}")
    except InitFileError as e:
        fail(f"bad init file: {e}")
    except DataError as e:
        fail(f"bad data: {e}")
    except CheckpointError as e:
        fail(f"bad checkpoint: {e}")
    except CoordinatorFailed as e:
        fail(f"the coordinator failed and must be restarted from its checkpoint: {e}", code=1)
    except (FileNotFoundError, ValueError) as e:
        fail(f"bad setup: {e}")


def main() -> None:
    check_renamed(sys.argv[1:])  # before hydra, which would only say the key is unknown
    _main()


if __name__ == "__main__":
    main()
