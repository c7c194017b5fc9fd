"""A run continues from a PyTorch distributed checkpoint (issue 32): an FSDP2 run's DCP checkpoint
converted into a toolkit run directory (``toolkit convert DCP RUN/checkpoints/step_N --to zero``)
and ``toolkit train --resume auto``: the next losses are the FSDP2 run's own continuation.

The FSDP2 run is a plain ``fully_shard`` + ``torch.optim.AdamW`` loop on 2 gloo ranks over the
toolkit's own global batches, learning rates and loss (tests/helpers/dcp.py ``fsdp2_toolkit_run``),
saved with ``dcp.save`` at step 2 and run on to step 4; the toolkit resumes at ZeRO-2 and at ZeRO-3
on 2 ranks (measured: both next losses within 3.3e-8 (ZeRO-2) and 4.9e-8 (ZeRO-3) of the FSDP2 run's).
ZeRO-3 was 4.9e-5 off while its CPU engine built fp32 models with bf16 weights (zero.Init's dtype,
fixed in adapters/deepspeed/engine.py); with that bug back this test fails at ZeRO-3 by 4.9e-5."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dcp import fsdp2_toolkit_run, toolkit_global_batches
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import TINY, losses, resumes, run_in_process, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]
STEPS = ["train.steps=4", "checkpoint.every=2"]
K = 2
REL = 1e-6
"""fp32 rounding: DeepSpeed and the FSDP2 loop reduce the same gradients in another order (3.3e-8 seen)."""


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_run_continues_as_a_zero_toolkit_run(tmp_path, data_cache, stage):
    from toolkit.config import load_config
    from toolkit.train.schedule import lr_at
    cfg = load_config(None, [*TINY, f"data.cache_dir={data_cache}", *STEPS])
    t = cfg.train
    hparams = {"weight_decay": t.weight_decay, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_eps}
    batches = toolkit_global_batches(cfg, t.steps)
    fsdp2 = run_ranks(fsdp2_toolkit_run, 2, tmp_path, cfg.model.name_or_path, batches,
                      [lr_at(s, t) for s in range(t.steps)], hparams, K, str(tmp_path / "fsdp2"))[0]
    run = tmp_path / "run"
    run_in_process(["convert", str(tmp_path / "fsdp2"), str(run / "checkpoints" / f"step_{K:08d}"), "--to", "zero",
                    "--dp", "2", "--zero-stage", str(stage), "--hf-config", cfg.model.name_or_path])
    train(run, data_cache, *STEPS, f"zero.stage={stage}", "resume=auto")
    assert resumes(run) == [(f"step_{K:08d}", K, "as saved")]
    resumed = losses(run)
    print(f"\nFSDP2 run {fsdp2}, resumed on ZeRO-{stage} {resumed}")
    assert len(resumed) == t.steps - K
    assert resumed == pytest.approx(fsdp2[K:], rel=REL)
