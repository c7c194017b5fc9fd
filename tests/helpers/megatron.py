"""Megatron training runs against DeepSpeed's: the tolerances the megatron training tests share and a
run's per-step values."""
from __future__ import annotations

from toolkit.observe.metrics import read_metrics

LOSS_RTOL = 3e-7
"""Losses vs DeepSpeed, relative. Measured max over the layouts: 9.9e-8 (tp2 layouts; dp2, pp2
8.3e-8), about one float32 ulp of the loss: the same fp32 math in other reduction orders."""
GRAD_NORM_RTOL = 3e-5
"""Measured max 1.2e-5 (tp2 layouts; dp2, pp2 5.7e-6): ZeRO-0 and megatron sum the squares in
other orders (4.2e-5 at step 6 with megatron's local attention)."""


def losses(run_dir, key="loss"):
    return [r[key] for _, r in sorted(read_metrics(run_dir).items()) if key in r]
