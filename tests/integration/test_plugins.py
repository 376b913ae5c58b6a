"""The trainer plug-ins (diloco.plugins) against a real coordinator served over gRPC on
127.0.0.1:0: a Hugging Face Trainer and a Lightning Trainer each become a site with one added
callback, train a tiny model from a config on the shipped corpus (bytes as token ids) for two
rounds, and stop; their θ, the hash they report when leaving, and the coordinator's agree."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from helpers import coordinator, served_coordinator

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.data import DataConfig, load_corpus
from diloco.outer import params_sha256

CONTEXT = 32
SYNC_EVERY = 3
ROUNDS = 2
BATCH = 4
ACCUMULATE = 2  # gradient accumulation: an optimizer step is two batches
TOKENS_PER_STEP = BATCH * ACCUMULATE * CONTEXT


def _windows(n: int = 64) -> torch.Tensor:
    """n windows of CONTEXT + 1 bytes, spread over the shipped corpus's train split, int64."""
    train = load_corpus(DataConfig(batch_size=BATCH), CONTEXT).train
    starts = torch.linspace(0, train.numel() - CONTEXT - 2, n).long()
    return train[starts[:, None] + torch.arange(CONTEXT + 1)].long()


def _hash(model: torch.nn.Module) -> str:
    return params_sha256(dict(model.named_parameters()))


def _check_run(coord: Coordinator, site_id: str, model: torch.nn.Module, first_step_hash: str, theta0: str) -> list[dict]:
    """What both plug-ins must leave behind; returns the coordinator's round records."""
    assert coord.committed_rounds == ROUNDS
    # The global θ was loaded into the model at train start, before the first step.
    assert first_step_hash == theta0
    # The site left reporting the coordinator's θ, and the model holds exactly that θ
    # (it stopped right after loading the last round's θ: no local step after it).
    assert coord.left_sites() == {site_id: coord.global_sha256()}
    assert _hash(model) == coord.global_sha256() != theta0
    records = [coord.recent_records()[r] for r in range(ROUNDS)]
    for rec in records:
        assert rec["participants"] == [site_id]
        assert rec["inner_steps"] == SYNC_EVERY
        assert rec["tokens"] == SYNC_EVERY * TOKENS_PER_STEP  # counted from the batches
        assert rec["train_loss"] is not None and math.isfinite(rec["train_loss"])
    return records


# ---- Hugging Face transformers ----------------------------------------------------------------


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64, n_inner=64)
    return GPT2LMHeadModel(cfg)


class _Windows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.w = _windows()

    def __len__(self) -> int:
        return len(self.w)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.w[i, :CONTEXT]
        return {"input_ids": x, "labels": x.clone()}  # GPT-2 shifts the labels itself


@pytest.mark.timeout(120)
def test_hf_trainer_callback_runs_two_rounds(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from diloco.plugins.hf import DiLoCoCallback

    seen: dict[str, str] = {}

    class FirstStep(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen.setdefault("hash", _hash(model))

    # θ_0 comes from another seed than the site's model: only a join loads it.
    coord = coordinator(dict(_gpt2(seed=0).named_parameters()), CoordinatorConfig(total_rounds=ROUNDS))
    with served_coordinator(coord) as address:
        model = _gpt2(seed=1)
        args = TrainingArguments(
            output_dir=str(tmp_path / "hf"),
            max_steps=50,
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUMULATE,
            learning_rate=3e-3,
            logging_steps=SYNC_EVERY,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        callback = DiLoCoCallback(coordinator=address, site_id="eu-1", sync_every=SYNC_EVERY)
        trainer = Trainer(model=model, args=args, train_dataset=_Windows(), callbacks=[callback, FirstStep()])
        trainer.train()
        theta0 = _hash(_gpt2(seed=0))
        records = _check_run(coord, "eu-1", model, seen["hash"], theta0)
    # The trainer stopped after the coordinator's last round, not at max_steps.
    assert trainer.state.global_step == ROUNDS * SYNC_EVERY
    # Each round reported the loss the Trainer logged at its last step (logging_steps = H).
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    for r, rec in enumerate(records):
        assert rec["train_loss"] == pytest.approx(logged[(r + 1) * SYNC_EVERY])


# ---- PyTorch Lightning -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_lightning_callback_runs_two_rounds(tmp_path) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from diloco.model import build_model, lm_loss, model_config
    from diloco.plugins.lightning import DiLoCoLightningCallback

    cfg = model_config("tiny", context=CONTEXT, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64)

    class TinyLM(pl.LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.model = build_model(cfg, seed=seed)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = lm_loss(self.model(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    seen: dict[str, str] = {}

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("hash", _hash(pl_module))

    w = _windows()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(w[:, :-1], w[:, 1:]), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    coord = coordinator(dict(TinyLM(seed=0).named_parameters()), CoordinatorConfig(total_rounds=ROUNDS))
    with served_coordinator(coord) as address:
        module = TinyLM(seed=1)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=50,
            accumulate_grad_batches=ACCUMULATE,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
            callbacks=[DiLoCoLightningCallback(coordinator=address, site_id="us-2", sync_every=SYNC_EVERY), FirstStep()],
        )
        trainer.fit(module, loader)
        records = _check_run(coord, "us-2", module, seen["hash"], _hash(TinyLM(seed=0)))
    # The trainer stopped after the coordinator's last round, not at max_steps.
    assert trainer.global_step == ROUNDS * SYNC_EVERY
    assert len(module.losses) == ROUNDS * SYNC_EVERY * ACCUMULATE
    # Each round reported the mean loss of its batches (accumulation handled).
    per_round = SYNC_EVERY * ACCUMULATE
    for r, rec in enumerate(records):
        assert rec["train_loss"] == pytest.approx(sum(module.losses[r * per_round : (r + 1) * per_round]) / per_round, rel=1e-5)


# ---- arguments and optional imports ------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plugin", ["hf", "lightning"])
def test_bad_arguments_name_the_argument(plugin: str) -> None:
    if plugin == "hf":
        pytest.importorskip("transformers")
        from diloco.plugins.hf import DiLoCoCallback as cls
    else:
        pytest.importorskip("lightning")
        from diloco.plugins.lightning import DiLoCoLightningCallback as cls
    with pytest.raises(ValueError, match="sync_every"):
        cls(coordinator="127.0.0.1:1", site_id="eu-1", sync_every=0)
    with pytest.raises(ValueError, match="site_id"):
        cls(coordinator="127.0.0.1:1", site_id="", sync_every=3)
    with pytest.raises(ValueError, match="tokens_per_step"):
        cls(coordinator="127.0.0.1:1", site_id="eu-1", sync_every=3, tokens_per_step=0)


@pytest.mark.timeout(60)
def test_import_diloco_does_not_import_the_frameworks() -> None:
    code = (
        "import sys, diloco, diloco.api, diloco.plugins; "
        "assert not {'transformers', 'lightning', 'pytorch_lightning', 'torchtitan'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


@pytest.mark.timeout(60)
def test_a_wrapped_model_syncs_the_users_names_in_one_process() -> None:
    # The Trainer gives callbacks its unwrapped model, but a wrapper that only renames the
    # parameters (DataParallel, torch.compile; DDP alike) is seen through: the site joins with
    # the user's names and loads θ into the same tensors.
    from diloco.plugins.common import SiteSettings
    from diloco.site.layouts.base import see_through

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    wrapped = torch.nn.DataParallel(torch.compile(model))  # compiled lazily: nothing is traced here
    assert see_through(wrapped) is model and see_through(model) is model
    theta0 = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}  # "0.weight", ... without "module._orig_mod."
    coord = coordinator(theta0, CoordinatorConfig(total_rounds=1))
    with served_coordinator(coord) as address:
        site = SiteSettings(coordinator=address, site_id="eu-1", sync_every=2).join(wrapped)
        try:
            assert all(torch.equal(p, theta0[n]) for n, p in model.named_parameters())
        finally:
            site.close()


def test_the_torchtitan_plugin_without_torchtitan_says_which_extra_to_install() -> None:
    # torchtitan made unimportable (as where it is not installed): the plug-in names the extra
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        "try:\n    import diloco.plugins.torchtitan\nexcept ImportError as e:\n    print(e)\nelse:\n    raise SystemExit('imported')"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=50, capture_output=True, text=True).stdout
    assert "pip install diloco[torchtitan]" in out and "torchtitan" in out, out
