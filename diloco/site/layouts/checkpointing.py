"""Activation checkpointing: each transformer block recomputes its activations in backward
instead of keeping them (less memory, about one more forward per step)."""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(model: nn.Module) -> None:
    """Makes every block of ``model.blocks`` recompute in backward; parameter names do not
    change (the wrapper's forward calls the block, whose parameters stay where they are)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError("activation checkpointing needs a model with a `blocks` list")
    for block in blocks:
        block.forward = _checkpointed_forward(block, block.forward)


def _checkpointed_forward(block: nn.Module, forward):  # type: ignore[no-untyped-def]
    def run(*args):  # type: ignore[no-untyped-def]
        return checkpoint(forward, *args, use_reentrant=False)

    return run
