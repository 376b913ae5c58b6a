"""The one-rank site: the model as it is."""

from diloco.site.layouts.base import ParallelModel as SingleModel

__all__ = ["SingleModel"]
