"""Inner layouts of a site: how its model is spread over the ranks of its torchrun group
(one file per kind of parallelism), and which slices each rank syncs."""

from diloco.site.layouts.config import LAYOUT_RANKS, LayoutConfig, layout_config

__all__ = ["LAYOUT_RANKS", "LayoutConfig", "layout_config"]
