"""Baselines measured with the same tool and output format as DiLoCo: ddp and single."""
