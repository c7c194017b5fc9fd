"""megatron.cp through `toolkit train`, on rows packed by documents: a cp = 2 run follows the
single-process run's loss curve; stopped at step 3 and resumed at cp = 2 it continues bit for bit;
its step-3 checkpoint resumes at cp = 1 and at tp = 2 (megatron reshards it on load) on the same curve."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.megatron import GRAD_NORM_RTOL, LOSS_RTOL, losses
from tests.helpers.runs import resumes, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

MEGATRON = ["backend=megatron", "checkpoint.every=3", "data.packing=documents"]  # rows carry document_ids
CP2 = [*MEGATRON, "megatron.cp=2"]


def test_cp2_runs_resume_exactly_and_at_cp1_and_tp2_on_the_single_process_curve(tmp_path, data_cache):
    from toolkit.observe.report import write_report
    reference, whole, stopped, at_cp1, at_tp2 = (tmp_path / n for n in ("cp1", "cp2", "cp2_stopped", "cp2_then_cp1",
                                                                         "cp2_then_tp2"))
    train(reference, data_cache, *MEGATRON, nproc=1)
    train(whole, data_cache, *CP2, nproc=2)
    layout = json.loads((whole / "megatron_layout.json").read_text())
    assert (layout["cp"], layout["dp"]) == (2, 1)
    assert "(tp=1 pp=1 cp=2)" in (write_report(whole) / "report.md").read_text()
    ref = losses(reference)
    print(f"\ncp=2 vs cp=1: max relative loss gap {max(abs(a - b) / b for a, b in zip(losses(whole), ref)):.2e}")
    assert losses(whole) == pytest.approx(ref, rel=LOSS_RTOL)
    assert losses(whole, "grad_norm") == pytest.approx(losses(reference, "grad_norm"), rel=GRAD_NORM_RTOL)

    train(stopped, data_cache, *CP2, "train.steps=3", nproc=2)
    shutil.copytree(stopped, at_cp1)
    shutil.copytree(stopped, at_tp2)
    train(stopped, data_cache, *CP2, nproc=2)  # the same layout: loaded as saved, RNG streams too
    assert [(step, how) for _, step, how in resumes(stopped)] == [(3, "as saved")]
    assert losses(stopped) == losses(whole)  # bit for bit

    train(at_cp1, data_cache, *MEGATRON, nproc=1)
    assert [(step, how) for _, step, how in resumes(at_cp1)] == [(3, "resharded")]
    print(f"cp=2 (steps 1-3) then cp=1 (4-6) vs cp=1: max relative loss gap "
          f"{max(abs(a - b) / b for a, b in zip(losses(at_cp1), ref)):.2e}")
    assert losses(at_cp1)[:3] == losses(whole)[:3]
    assert losses(at_cp1) == pytest.approx(ref, rel=LOSS_RTOL)

    train(at_tp2, data_cache, *MEGATRON, "megatron.tp=2", nproc=2)
    assert [(step, how) for _, step, how in resumes(at_tp2)] == [(3, "resharded")]
    print(f"cp=2 (steps 1-3) then tp=2 (4-6) vs cp=1: max relative loss gap "
          f"{max(abs(a - b) / b for a, b in zip(losses(at_tp2), ref)):.2e}")
    assert losses(at_tp2)[:3] == losses(whole)[:3]
    assert losses(at_tp2) == pytest.approx(ref, rel=LOSS_RTOL)
