"""DPO through ``toolkit train`` on both backends: the loss contract for pairs (the mean pair loss over the
global batch whatever the DP size, micro-batches or backend layout, megatron TP 2 x DP 2 included) on pairs
of very different lengths, packed several to a row (megatron's runs score their own reference, so its
document scoring is compared too); TRL's reward metrics reduced over the global batch alike; the same eval
rows at every layout give the one-process eval; kill and resume bit for bit, from the cached reference
scores and with them removed (scored again before the checkpoint loads)."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.helpers.dpo import write_preference_data
from tests.helpers.runs import losses, resumes, train
from toolkit.objectives import DPO_METRICS
from toolkit.observe.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

BASE = ("data.seq_len=128", "train.steps=4", "train.global_batch_size=8", "train.warmup_steps=1",
        "train.eval_every=2", "checkpoint.every=2", "train.log_every=1", "data.format=json",
        "data.template=preference", "train.objective=dpo", "dpo.beta=0.5", "train.lr=3e-3")
MODES = {
    "reference": (("zero.stage=0", "train.micro_batch_size=8"), 1),
    "zero0_dp2_micro2": (("zero.stage=0", "train.micro_batch_size=2"), 2),
    "zero1_dp2_micro1": (("zero.stage=1", "train.micro_batch_size=1"), 2),
    "zero2_dp2_micro2": (("zero.stage=2", "train.micro_batch_size=2"), 2),
    "zero3_dp2_micro2": (("zero.stage=3", "train.micro_batch_size=2"), 2),
    "megatron_tp2_micro1": (("backend=megatron", "megatron.tp=2", "train.micro_batch_size=1"), 2),
    "megatron_pp2_micro2": (("backend=megatron", "megatron.pp=2", "train.micro_batch_size=2"), 2),
    # every dimension above 1: each DP replica scores its rows' reference over its TP pair, evals its own rows
    "megatron_tp2_dp2_micro1": (("backend=megatron", "megatron.tp=2", "train.micro_batch_size=1"), 4),
    # LoRA (the reference: the base, adapters off): megatron TP2 against DeepSpeed's one-process LoRA DPO,
    # whose objective with peft equals TRL + peft (tests/unit/test_dpo.py); both draw peft's adapter init
    "lora_reference": (("zero.stage=0", "train.micro_batch_size=8", "lora.rank=4"), 1),
    "megatron_lora_tp2_micro1": (("backend=megatron", "megatron.tp=2", "train.micro_batch_size=1", "lora.rank=4"), 2),
}
LOSS_RTOL = 3e-6  # measured max 1.9e-7 (ZeRO-0 DP2 x 2), 4.7e-7 (ZeRO-1 DP2 x 1), 3.0e-7 (ZeRO-3), 1.03e-6 (TP2),
#                   2.5e-7 (TP2 LoRA)
GRAD_NORM_RTOL = 5e-5  # measured max 1.4e-5 (ZeRO-1 DP2 x 1), 2.9e-5 (ZeRO-3 DP2 x 2), 5.4e-7 (TP2 LoRA)
METRIC_ATOL = 1e-5  # rewards (beta x log-ratios), accuracies, per-answer log-probabilities (~1e2: relative 1e-7)
EVAL_ROWS = 8  # every mode evaluates the same first rows: train.eval_batches x DP x micro-batch = 8


def _eval_batches(overrides: tuple, nproc: int) -> str:
    """``train.eval_batches`` for EVAL_ROWS rows in this mode's layout."""
    sets = dict(o.split("=", 1) for o in overrides)
    model_parallel = int(sets.get("megatron.tp", 1)) * int(sets.get("megatron.pp", 1))
    return f"train.eval_batches={EVAL_ROWS // (nproc // model_parallel * int(sets['train.micro_batch_size']))}"


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory, data_cache, demo_base):
    """Runs by mode name, from the demo's tiny Llama saved as a pretrained base (DPO starts from a trained
    model)."""
    root = tmp_path_factory.mktemp("dpo")
    data = write_preference_data(root / "pairs.jsonl")
    done = {}

    def get(mode: str):
        if mode not in done:
            overrides, nproc = MODES[mode]
            if "backend=megatron" in overrides:  # scores its own reference (megatron's document_logps)
                overrides = (*overrides, f"data.cache_dir={root / ('cache_' + mode)}")
            train(root / mode, data_cache, *BASE, f"data.path={data}", f"model.name_or_path={demo_base}",
                  "model.init=pretrained", *overrides, _eval_batches(overrides, nproc), nproc=nproc, base=[])
            done[mode] = root / mode
        return done[mode]
    get.data, get.base = data, demo_base
    return get


def _records(run_dir) -> list[dict]:
    return [r for _, r in sorted(read_metrics(run_dir).items())]


def _micro_batch_pairs(run_dir, rows: int = 2) -> list[list[int]]:
    """Pairs in each ``rows``-row micro-batch of each global batch the run trained on, in order (the rows
    ``toolkit.data`` gives the ranks: DP rank r the r-th contiguous half), counted from the packed data."""
    from toolkit.data import batch_counts, global_batch_indices, load_tokenizer, prepare_data
    from toolkit.plan import read_plan
    cfg = read_plan(run_dir / "plan.json").config
    ds, t = prepare_data(cfg, load_tokenizer(cfg)).train, cfg.train
    batches = [global_batch_indices(len(ds), t.global_batch_size, t.seed, step) for step in range(t.steps)]
    return [[batch_counts(ds, b[i:i + rows])["pairs"] for i in range(0, len(b), rows)] for b in batches]


def test_pairs_are_uneven(dpo_runs):
    """Guard on the data: in every global batch the DP halves, and the micro-batches of two rows, hold
    different numbers of pairs, several per row, so a mean of per-rank or per-micro-batch mean losses is not
    the global batch's mean the loss contract asks for; the counts add up to each step's logged pairs."""
    run = dpo_runs("reference")
    records, micro = _records(run), _micro_batch_pairs(run)
    assert len(records) == len(micro) == 4
    for record, pairs in zip(records, micro):
        assert sum(pairs) == record["pairs"] > 8, (record["pairs"], pairs)  # several pairs per row
        assert sum(pairs[:2]) != sum(pairs[2:]) and len(set(pairs)) > 1, pairs


@pytest.mark.parametrize("mode", [m for m in MODES if not m.endswith("reference")])
def test_loss_grad_norm_and_rewards_match_one_micro_batch_in_one_process(mode, dpo_runs):
    want = _records(dpo_runs("lora_reference" if "lora" in mode else "reference"))
    got = _records(dpo_runs(mode))
    assert len(got) == len(want) == 4
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        gap = max(abs(g[key] - w[key]) / abs(w[key]) for g, w in zip(got, want))
        print(f"\n{mode} {key}: max relative gap {gap:.2e}")
        assert [g[key] for g in got] == pytest.approx([w[key] for w in want], rel=rtol), key
    for name in DPO_METRICS:
        assert [g[name] for g in got] == pytest.approx([w[name] for w in want], abs=METRIC_ATOL, rel=1e-6), name
    assert [g["pairs"] for g in got] == [w["pairs"] for w in want]
    assert got[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # step 1: the policy is the reference


def _evals(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]


@pytest.mark.parametrize("mode", [m for m in MODES if not m.endswith("reference")])
def test_eval_matches_one_micro_batch_in_one_process(mode, dpo_runs):
    """The same 8 eval rows at every layout (``train.eval_batches`` scaled by DP x micro-batch): each DP
    rank's rows against their own reference scores give the one-process eval's loss and pairs."""
    want = _evals(dpo_runs("lora_reference" if "lora" in mode else "reference"))
    got = _evals(dpo_runs(mode))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 4]
    assert [r["eval_pairs"] for r in got] == [r["eval_pairs"] for r in want]
    assert all(r["eval_pairs"] > EVAL_ROWS for r in want)  # several pairs per row
    assert [r["eval_loss"] for r in got] == pytest.approx([r["eval_loss"] for r in want], rel=LOSS_RTOL)


def test_kill_and_resume_is_bitwise_exact(dpo_runs, tmp_path, data_cache):
    """Killed after step 3, restarted from the step-2 checkpoint (reference scores from the cache, their key
    checked against trainer.json's); killed again after step 4, before its save, the restarts spent. Launched
    again with the reference cache removed (a cleared cache, another machine): the scores are made again
    from the base, before the step-2 checkpoint loads. The uninterrupted run's losses and rewards bit for bit."""
    overrides, nproc = MODES["zero1_dp2_micro1"]
    run_dir, cache = tmp_path / "killed", tmp_path / "cache"
    sets = (*BASE, f"data.path={dpo_runs.data}", f"model.name_or_path={dpo_runs.base}", "model.init=pretrained",
            *overrides, _eval_batches(overrides, nproc), f"data.cache_dir={cache}", "restart.max_restarts=1",
            "restart.backoff_s=0.2")
    killed = train(run_dir, data_cache, *sets, env={"TOOLKIT_FAULT": "kill:step=3:rank=1;kill:step=4:rank=0"},
                   nproc=nproc, base=[], check=False)
    assert killed.returncode != 0 and resumes(run_dir) == [("step_00000002", 2, "as saved")]
    scores, = cache.rglob("reference/*/meta.json")
    shutil.rmtree(scores.parent)
    train(run_dir, data_cache, *sets, nproc=nproc, base=[])  # each fault fires once per run directory
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")] * 2 and scores.is_file()  # scored again
    want = dpo_runs("zero1_dp2_micro1")
    assert losses(run_dir) == losses(want)
    assert [r["rewards/margins"] for r in _records(run_dir)] == [r["rewards/margins"] for r in _records(want)]
    progress = json.loads((run_dir / "checkpoints" / "step_00000004" / "trainer.json").read_text())
    assert len(progress["reference"]) == 24


def test_a_dpo_step_reads_its_loss_and_metrics_in_one_host_sync(dpo_runs):
    """Megatron's DPO step waits on the host as often as its SFT step (4: megatron's grad norm, 3, and one
    ``.tolist()`` of the loss with every metric; tests/e2e/test_megatron_train.py): reading each metric
    on its own made it 11, a GPU stall per metric per step."""
    assert {r["host_syncs"] for r in _records(dpo_runs("megatron_tp2_micro1"))} == {4}
