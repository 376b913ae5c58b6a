"""DiLoCo: low-communication distributed training across far-apart sites.

``DiLoCo`` (diloco.api) turns an existing training loop into a site; ``diloco-sim``,
``diloco-coordinator`` and ``diloco-site`` are the command-line entry points.
"""

from typing import Any

__all__ = ["DiLoCo", "RunFinished", "RunFinishedWarning", "SecurityConfig", "init_distributed"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing diloco.model or diloco.outer does not pull in grpc.
    if name == "init_distributed":
        from diloco.site.layouts.build import init_distributed

        return init_distributed
    if name in __all__:
        import diloco.api

        return getattr(diloco.api, name)
    raise AttributeError(name)
