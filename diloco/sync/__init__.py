"""When and how sites exchange with the coordinator: the ``sync`` section (config.py), the
run's rounds in inner steps (schedule.py), and the settings every site shares, which the
coordinator owns and hands out at Join (settings.py)."""

from diloco.sync.config import FragmentEnd, FragmentSplit, Merge, Preset, SyncConfig, SyncMode
from diloco.sync.schedule import SyncSchedule
from diloco.sync.settings import SHARED, SITE_OWN, RunSettings, flatten, parse_stated

__all__ = [
    "SHARED",
    "SITE_OWN",
    "FragmentEnd",
    "FragmentSplit",
    "Merge",
    "Preset",
    "RunSettings",
    "SyncConfig",
    "SyncMode",
    "SyncSchedule",
    "flatten",
    "parse_stated",
]
