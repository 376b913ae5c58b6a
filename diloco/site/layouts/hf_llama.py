"""Tensor parallelism for Hugging Face Llama-style causal LMs (llama, mistral, qwen2, ...: every
decoder layer has ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``), for

    diloco-sim model=hf model.parallelize=diloco.site.layouts.hf_llama:parallelize parallel.tp=2

Megatron style, as the built-in transformer's plan: q, k, v, gate and up column-wise (each tp
rank computes some of the heads and some of the MLP's hidden units), o and down row-wise (their
partial outputs summed). The embeddings, the norms and the head stay whole on every tp rank.
The attention reshapes its projections with ``view(..., -1, head_dim)``, so a rank's share of
the heads runs as a smaller attention; the heads and the key/value heads must divide by tp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def tp_problem(config: Mapping[str, Any], tp: int) -> str | None:
    """Why a model of this Hugging Face ``config`` (a mapping) cannot be split over ``tp``
    ranks, or None."""
    heads = config.get("num_attention_heads")
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads", heads),
        "intermediate_size": config.get("intermediate_size"),
    }
    for key, value in sizes.items():
        if isinstance(value, int) and value % tp:
            return f"model.config.{key}={value} is not divisible by it (each tensor-parallel rank computes {key} / tp of them)"
    return None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules with a Llama-style attention and MLP, in order."""
    layers = []
    for module in model.modules():
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        if attn is not None and mlp is not None and all(hasattr(attn, n) for n in ATTENTION) and all(hasattr(mlp, n) for n in MLP):
            layers.append(module)
    return layers


def parallelize(model: nn.Module, device_mesh: Any) -> None:
    """Applies tensor parallelism to ``model`` over ``device_mesh["tp"]`` (the site's mesh; a
    1-D mesh is taken as the tp dimension itself)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = device_mesh["tp"] if device_mesh.ndim > 1 else device_mesh
    config = getattr(model, "config", None)
    why = tp_problem(config.to_dict() if hasattr(config, "to_dict") else {}, tp.size())
    if why is not None:
        raise ValueError(f"tensor parallelism over {tp.size()} ranks: {why}")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"diloco.site.layouts.hf_llama:parallelize: {type(model).__name__} has no Llama-style decoder layer "
            f"(self_attn.{{{','.join(ATTENTION)}}} and mlp.{{{','.join(MLP)}}}); write a parallelize function for this model"
        )
    plan = {
        **{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        **{f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in layers:
        parallelize_module(layer, tp, plan)
