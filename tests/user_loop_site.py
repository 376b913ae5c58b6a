"""A user's own training loop made a DiLoCo site: a two-layer MLP the project does not know,
on synthetic regression data, with plain PyTorch. Run as a separate process by the tests:

    python tests/user_loop_site.py --coordinator HOST:PORT --site-id a --seed 1 --steps 15 \
        --sync-every 5 --out result.json

Each site builds its model from its own seed; with init=site the coordinator's θ₀ is the
first site's parameters and every site starts from it. Writes the per-round hashes of the
site's copy of θ, the losses of every step and the site's final model hash to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from diloco import DiLoCo
from diloco.outer import params_sha256


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--site-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The task every site learns: y = x·w + noise, w fixed for the run; x drawn per site.
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1234))
    data = torch.Generator().manual_seed(100 + args.seed)
    losses = []
    with DiLoCo(model, optimizer, coordinator=args.coordinator, site_id=args.site_id, sync_every=args.sync_every) as dl:
        start_hash = params_sha256(dict(model.named_parameters()))
        for _ in range(args.steps):
            x = torch.randn(32, 16, generator=data)
            y = x @ w + 0.01 * torch.randn(32, 1, generator=data)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            dl.record_loss(loss, tokens=x.shape[0])  # before the step: its tokens weigh this step
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            if dl.finished:
                break
    result = {
        "round_sha256": {str(r): h for r, h in sorted(dl.sync.stats.round_hashes.items())},
        "global_sha256": dl.sync.global_sha256(),
        "start_sha256": start_hash,  # the model right after joining: θ₀
        "uploaded_init": dl.sync.uploaded_init,
        "losses": losses,
        "rounds": dl.round,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
