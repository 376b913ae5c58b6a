"""The processes of a run and what they write: the run config (config.py), the coordinator's
and a site's main (coordinator.py, site.py), the data-parallel baselines (baseline.py), and
the typed records of every file in a run directory (records.py). The top of the library:
nothing below imports it."""
