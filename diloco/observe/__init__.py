"""What a run shows while it runs and after (docs/observability.md).

- TensorBoard scalars: tensorboard.py; Prometheus metrics: prom.py (the endpoint),
  coordinator_metrics.py, site_metrics.py; their settings: config.py;
- one log format for every process: logs.py;
- a run directory read for plots and reports: rundata.py, timeline.py.

The modules import their libraries (tensorboard, prometheus_client, matplotlib) only where
they are used, so a process that turns a feature off does not pay for it.
"""
