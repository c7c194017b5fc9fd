"""``toolkit train`` with ``data.packing`` on both backends, weights fixed (lr=0) on a corpus of one
instruction repeated: every document's loss is the same whatever it is grouped with, so ``documents``
must give exactly the losses of ``pad`` (a leaked mask or position reset shows), while ``concat``
(documents see their predecessors, positions run on) visibly differs."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.runs import losses, resumes, train
from tests.helpers.uneven_data import BASE, write_uneven_data
from toolkit.observe.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

SAME_RTOL = 1e-6  # documents vs pad: measured max 4.7e-8 (DeepSpeed), 1.2e-7 (megatron)
CONCAT_MIN_GAP = 1e-3  # concat vs pad: measured 5.3e-3 on both; documents leaking: see notes
FIXED = ("data.seq_len=128", "train.steps=2", "train.global_batch_size=8", "train.micro_batch_size=2", "train.lr=0",
         "train.min_lr=0", "train.warmup_steps=0", "train.eval_every=0", "train.log_every=1", "checkpoint.every=100",
         "train.export_hf=false", "data.eval_fraction=0", "data.format=json", "data.template=instruction")


@pytest.fixture(scope="module")
def repeated_instruction(tmp_path_factory):
    path = tmp_path_factory.mktemp("packing") / "same.jsonl"
    row = {"prompt": "Reverse the words: one two three four", "response": "four three two one"}
    path.write_text((json.dumps(row) + "\n") * 64)
    return path


def run(tmp_path, data_cache, data, backend: str, packing: str) -> dict[int, dict]:
    run_dir = tmp_path / f"{backend}-{packing}"
    train(run_dir, data_cache, *FIXED, f"backend={backend}", f"data.path={data}", f"data.packing={packing}", base=[])
    return read_metrics(run_dir)


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_documents_give_the_losses_of_pad_and_concat_differs(backend, tmp_path, data_cache, repeated_instruction):
    got = {mode: run(tmp_path, data_cache, repeated_instruction, backend, mode) for mode in ("documents", "pad", "concat")}
    loss = {mode: [r["loss"] for _, r in sorted(m.items())] for mode, m in got.items()}
    gap = max(abs(a - b) / b for a, b in zip(loss["documents"], loss["pad"]))
    concat_gap = min(abs(a - b) / b for a, b in zip(loss["concat"], loss["pad"]))
    print(f"\n{backend}: losses {loss}; documents vs pad {gap:.2e}, concat vs pad {concat_gap:.2e}")
    assert len(loss["pad"]) == 2 and gap < SAME_RTOL and concat_gap > CONCAT_MIN_GAP
    efficiency = {mode: got[mode][1]["packing_efficiency"] for mode in got}
    per_row = {mode: got[mode][1].get("documents_per_row") for mode in got}
    assert efficiency["concat"] == 1.0 and efficiency["pad"] < efficiency["documents"] < 1.0
    assert per_row["pad"] == 1.0 and per_row["documents"] > 2 and per_row["concat"] is None


def test_documents_resume_exactly_after_a_kill(tmp_path, data_cache):
    """Rows packed by documents (the uneven instruction data: long prompts split) are fixed by the
    data and the mode, their order by (seed, step): a run killed at step 3 and restarted from its
    step-2 checkpoint logs the uninterrupted run's losses bit for bit (megatron PP2: positions and
    masks through the pipeline)."""
    data = write_uneven_data(tmp_path / "uneven.jsonl")
    args = (*BASE, f"data.path={data}", "data.packing=documents", "checkpoint.every=2", "train.micro_batch_size=2",
            "backend=megatron", "megatron.pp=2")
    train(tmp_path / "a", data_cache, *args, base=[])
    train(tmp_path / "b", data_cache, *args, "restart.max_restarts=1", "restart.backoff_s=0.2",
          env={"TOOLKIT_FAULT": "kill:step=3:rank=1"}, base=[])
    assert resumes(tmp_path / "b") == [("step_00000002", 2, "as saved")]
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
