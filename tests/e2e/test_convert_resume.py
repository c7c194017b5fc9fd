"""Train k steps, convert the checkpoint to the other backend, train on through the toolkit's own
resume: the loss at step k+1 matches the uninterrupted run (weights carried exactly), and step k+2
stays close (Adam moments and step carried, not reset). End to end through the CLI."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import losses, resumes, run_in_process, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]
STEPS = ["train.steps=4", "checkpoint.every=2"]
MEGATRON_TP2 = ["backend=megatron", "megatron.tp=2"]
K = 2


def _convert_and_resume(tmp_path, data_cache, source_run, to_args, target_overrides):
    ckpt = source_run / "checkpoints" / "step_00000002"
    resumed = tmp_path / "resumed"
    run_in_process(["convert", str(ckpt), str(resumed / "checkpoints" / "step_00000002"), *to_args])
    train(resumed, data_cache, *STEPS, *target_overrides, "resume=auto")
    assert resumes(resumed) == [("step_00000002", K, "as saved")]  # the converted checkpoint, at its layout
    return losses(source_run), losses(resumed)


def _assert_continues(full, resumed):
    assert len(full) == 4 and len(resumed) == 2, (full, resumed)
    assert resumed[0] == pytest.approx(full[K], rel=1e-5), "step k+1: weights not carried exactly"
    assert resumed[1] == pytest.approx(full[K + 1], rel=1e-4), "step k+2: optimizer state not carried"


def test_zero_to_megatron_resume_continues_loss(tmp_path, data_cache):
    full = tmp_path / "zero"
    train(full, data_cache, *STEPS, "zero.stage=2")
    a, b = _convert_and_resume(tmp_path, data_cache, full, ["--to", "megatron", "--tp", "2"], MEGATRON_TP2)
    _assert_continues(a, b)


def test_megatron_to_zero_resume_continues_loss(tmp_path, data_cache):
    full = tmp_path / "megatron"
    train(full, data_cache, *STEPS, *MEGATRON_TP2)
    a, b = _convert_and_resume(tmp_path, data_cache, full, ["--to", "zero", "--dp", "2", "--zero-stage", "3"],
                               ["zero.stage=3"])
    _assert_continues(a, b)
