"""ORPO through ``toolkit train`` at layouts where every parallel dimension in play is 2 (ZeRO-2 DP 2, megatron
TP 2 x DP 2; two micro-batches of two rows per rank): the loss, grad norm and TRL's metrics of every step, and the
eval's, equal the one-process run's on the same global batches of uneven pairs. Each micro-batch weighs its
chosen documents' NLL by its whole global batch's chosen tokens (``objectives/orpo.py``: ``ChosenTokens``),
so a per-rank or per-micro-batch mean would show here; the one-process run itself equals TRL's ORPOTrainer
(``tests/unit/test_orpo.py``)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.dpo import write_preference_data
from tests.helpers.orpo import metric_gap
from tests.helpers.runs import train
from toolkit.objectives.orpo import ORPO_METRICS
from toolkit.observe.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

BASE = ("data.seq_len=128", "train.steps=3", "train.global_batch_size=8", "train.warmup_steps=1",
        "train.eval_every=1", "checkpoint.every=0", "train.log_every=1", "data.format=json", "train.export_hf=false",
        "data.template=preference", "train.objective=orpo", "orpo.beta=0.5", "train.lr=3e-3")
MODES = {  # overrides, ranks, eval micro-batches per rank (8 eval rows in every mode)
    "reference": (("zero.stage=0", "train.micro_batch_size=8"), 1, 1),
    "zero2_dp2_micro2": (("zero.stage=2", "train.micro_batch_size=2"), 2, 2),
    "megatron_tp2_dp2_micro2": (("backend=megatron", "megatron.tp=2", "train.micro_batch_size=2"), 4, 2),
}
# Measured (relative, max over 3 steps or 3 evals; ZeRO-2 DP2 / megatron TP2 x DP2): loss 1.5e-8 / 1.9e-8, eval
# loss 1.1e-8 / 1.5e-8, grad norm 9.0e-6 / 5.2e-6, metrics at most 9.1e-8 / 1.3e-7 (log_odds_ratio; margins against
# their operands: tests/helpers/orpo.py::metric_gap).
LOSS_RTOL = 1e-6
GRAD_NORM_RTOL = 5e-5  # DPO's bound at the same layouts (tests/e2e/test_dpo_train.py)
METRIC_RTOL = 1e-6


@pytest.fixture(scope="module")
def orpo_runs(tmp_path_factory, data_cache, demo_base):
    root = tmp_path_factory.mktemp("orpo")
    data = write_preference_data(root / "pairs.jsonl")
    out = {}
    for mode, (overrides, nproc, evals) in MODES.items():
        train(root / mode, data_cache, *BASE, f"data.path={data}", f"model.name_or_path={demo_base}",
              "model.init=pretrained", *overrides, f"train.eval_batches={evals}", nproc=nproc, base=[])
        records = [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines()]
        out[mode] = {"steps": [r for _, r in sorted(read_metrics(root / mode).items())],
                     "evals": [r for r in records if "eval_loss" in r]}
    return out


def _gap(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "reference"])
def test_steps_and_evals_match_one_process(mode, orpo_runs):
    want, got = orpo_runs["reference"], orpo_runs[mode]
    assert len(got["steps"]) == len(want["steps"]) == 3 and len(got["evals"]) == len(want["evals"]) == 3
    assert [g["pairs"] for g in got["steps"]] == [w["pairs"] for w in want["steps"]]
    assert [g["eval_pairs"] for g in got["evals"]] == [w["eval_pairs"] for w in want["evals"]]
    gaps = {}
    for key in ("loss", "grad_norm"):
        gaps[key] = max(_gap(g[key], w[key]) for g, w in zip(got["steps"], want["steps"]))
    gaps["eval_loss"] = max(_gap(g["eval_loss"], w["eval_loss"]) for g, w in zip(got["evals"], want["evals"]))
    for name in (*ORPO_METRICS, "nll_loss"):
        gaps[name] = max(metric_gap(name, g, w) for g, w in zip(got["steps"], want["steps"]))
        gaps[f"eval_{name}"] = max(metric_gap(name, g, w, "eval_") for g, w in zip(got["evals"], want["evals"]))
    print(f"\n{mode}: " + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items()))
    bounds = {"loss": LOSS_RTOL, "grad_norm": GRAD_NORM_RTOL, "eval_loss": LOSS_RTOL}
    failed = {k: v for k, v in gaps.items() if v >= bounds.get(k, METRIC_RTOL)}
    assert failed == {}
