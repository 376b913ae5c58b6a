"""Trainer plug-ins: an existing trainer becomes a DiLoCo site with one added argument.

- ``diloco.plugins.hf.DiLoCoCallback``: Hugging Face ``transformers.Trainer``
  (``Trainer(..., callbacks=[DiLoCoCallback(coordinator="host:port", site_id="eu-1", sync_every=100)])``).
- ``diloco.plugins.lightning.DiLoCoLightningCallback``: PyTorch Lightning
  (``lightning.pytorch.Trainer(callbacks=[DiLoCoLightningCallback(...)])``).
- ``diloco.plugins.torchtitan.DiLoCoTrainer``: torchtitan's ``Trainer`` subclassed, with a
  ``diloco`` config section (``--module diloco.plugins.torchtitan``; docs/torchtitan.md).

Both drive ``diloco.api.DiLoCo`` by hand (join, after each optimizer step, leave). Each
module imports its framework at the top, so only importing that module needs it installed;
``import diloco`` and ``import diloco.plugins`` need none of them.
"""
