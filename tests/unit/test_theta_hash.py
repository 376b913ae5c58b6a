"""θ's hash (params_sha256) is two-level: the same digest however the tensors are split between
the processes that hash them, and written block by block (the blockwise commit) or at once.
Coordinator checkpoints written before it (the one-level hash) still restore."""

from __future__ import annotations

import pytest
import torch

from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.service import Coordinator
from diloco.outer import OuterConfig, params_sha256
from diloco.outer.pseudo_gradient import combine_sha256, params_sha256_v1, tensor_header, tensor_sha256

pytestmark = pytest.mark.timeout(30)


def _theta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "b.weight": torch.randn(7, 5, generator=g),
        "a.bias": torch.randn(3, generator=g),
        "c.empty": torch.empty(0),
        "d.half": torch.randn(4, generator=g).half(),
    }


@pytest.mark.parametrize(
    "split",
    [[["a.bias", "b.weight", "c.empty", "d.half"]], [["d.half", "a.bias"], ["c.empty", "b.weight"]], [["a.bias"], ["b.weight"], ["c.empty"], ["d.half"]]],
)
def test_any_split_of_the_tensors_gives_the_same_digest(split: list[list[str]]) -> None:
    theta = _theta()
    parts = {}
    for names in split:  # each part hashes its own tensors, as a shard of the coordinator would
        parts.update({n: (tensor_header(n, theta[n]), tensor_sha256(theta[n])) for n in names})
    assert combine_sha256(parts) == params_sha256(theta)


def test_the_digest_sees_every_value_name_shape_and_dtype() -> None:
    theta = _theta()
    base = params_sha256(theta)
    changed = dict(theta, **{"b.weight": theta["b.weight"].clone()})
    changed["b.weight"][6, 4] += 1e-6
    renamed = {("z" if n == "a.bias" else n): t for n, t in theta.items()}
    reshaped = dict(theta, **{"b.weight": theta["b.weight"].reshape(5, 7)})
    retyped = dict(theta, **{"d.half": theta["d.half"].bfloat16()})
    assert len({base, params_sha256(changed), params_sha256(renamed), params_sha256(reshaped), params_sha256(retyped)}) == 5
    assert params_sha256_v1(theta) != base  # another format: a checkpoint says which it holds by matching one


def test_a_checkpoint_with_the_one_level_hash_restores_and_a_wrong_hash_is_refused() -> None:
    theta = _theta()
    cfg = CoordinatorConfig(total_rounds=3)
    state = Coordinator(theta, OuterConfig(), cfg)._checkpoint_state()
    old = dict(state, global_sha256=params_sha256_v1(state["outer"]["params"]))
    again = Coordinator(None, OuterConfig(), cfg)
    again.restore(old)
    assert again.global_sha256() == params_sha256(state["outer"]["params"])
    with pytest.raises(ValueError, match="hashes to"):
        Coordinator(None, OuterConfig(), cfg).restore(dict(state, global_sha256="0" * 64))
