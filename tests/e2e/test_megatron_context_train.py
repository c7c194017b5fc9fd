"""megatron.cp through `toolkit train`: a cp = 2 run on rows packed by documents follows the
single-process run's loss curve, and its checkpoint resumes at cp = 1 (megatron reshards it on
load) on the same curve."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.megatron import GRAD_NORM_RTOL, LOSS_RTOL, losses
from tests.helpers.runs import resumes, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

MEGATRON = ["backend=megatron", "checkpoint.every=3", "data.packing=documents"]  # rows carry document_ids


def test_cp2_run_and_its_resume_at_cp1_follow_the_single_process_curve(tmp_path, data_cache):
    reference, run_dir = tmp_path / "cp1", tmp_path / "cp2"
    train(reference, data_cache, *MEGATRON, nproc=1)
    train(run_dir, data_cache, *MEGATRON, "megatron.cp=2", "train.steps=3", nproc=2)
    layout = json.loads((run_dir / "megatron_layout.json").read_text())
    assert (layout["cp"], layout["dp"]) == (2, 1)
    cp2 = losses(run_dir)
    train(run_dir, data_cache, *MEGATRON, nproc=1)  # the same run dir, now at cp = 1: resumes step 3
    assert [(step, how) for _, step, how in resumes(run_dir)] == [(3, "resharded")]
    ref, got = losses(reference), losses(run_dir)
    print(f"\ncp=2 (steps 1-3) then cp=1 (4-6) vs cp=1: max relative loss gap "
          f"{max(abs(a - b) / b for a, b in zip(got, ref)):.2e}")
    assert len(got) == 6 and got[:3] == cp2
    assert got == pytest.approx(ref, rel=LOSS_RTOL)
    assert losses(run_dir, "grad_norm") == pytest.approx(losses(reference, "grad_norm"), rel=GRAD_NORM_RTOL)
