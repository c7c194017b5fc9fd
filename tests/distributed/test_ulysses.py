"""DeepSpeed Ulysses sequence parallelism (``zero.sp=2``: world 2, dp 1, each rank half of every row)
against HF's own model in one process (``tests/helpers/ulysses.py``: each document of a packed row run
alone through HF's attention, so neither the toolkit's attention nor DeepSpeed is in the reference):
the engine's logits, its step's loss and grad norm (``train_step``), and every parameter's whole
gradient at the accumulation boundary, on rows packed by documents with uneven loss tokens (rows and
halves of rows), documents crossing the split. One 2-rank job runs every case:

- llama (GQA 4/2), documents, ZeRO-1;
- qwen2 (q/k/v biases, untied), documents, ZeRO-3 with activation checkpointing;
- gemma2 (attention and final softcaps, a window of 6 on every other layer), documents, ZeRO-2;
- llama with one KV head (DeepSpeed's all-to-all replicates it over sp), plain rows, ZeRO-0;
- LoRA on llama, plain rows, ZeRO-2, against HF + peft (``tests/helpers/lora.py``'s adapters and reference);
- mixtral (4 experts top-2, a window of 8, tied), documents, ZeRO-3 (its MoE blocks ZeRO-3 leaf modules), with
  the router's load-balancing loss at a large coefficient: the reference adds transformers' own
  ``load_balancing_loss_func`` over the whole micro-batch's real tokens (``router_reference``), and the
  step's metrics must report the whole aux and each token's routing once;
- qwen2, plain rows, 2-row micro-batches, ZeRO-1: each rank's slice of a [2, s] batch is a view
  with row strides (its positions an expanded arange, stride 0 across rows), which DeepSpeed's wrapper
  all-gathers every layer; NCCL refuses non-contiguous tensors where gloo copies them, and the suite's
  strict device mode refuses them as NCCL does (every case before this one had 1-row micro-batches).

A 4-rank job runs sp=2 x dp=2 (llama, documents, 2-row micro-batches, ZeRO-3 partitioned over all
four ranks) against HF on the whole global batch, and asserts each rank's (dp, sp) place against
DeepSpeed's own sequence-parallel groups; another runs sp=4.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ulysses import (
    GRAD_RTOL,
    LOGIT_TOL,
    LOSS_RTOL,
    grad_ratios,
    hf_reference,
    observed_step,
    rows,
    sp_engine,
)
from tests.helpers.zoo import save_base

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

CASES = {  # name: (zoo variant, packing, ZeRO stage, activation checkpointing, LoRA)
    "llama": ("llama-tied-llama3", "documents", 1, False, False),
    "gemma2": ("gemma2-tied-hd", "documents", 2, False, False),
    "llama_mqa": ("llama-mqa-linear-hd", "concat", 0, False, False),
    "qwen2": ("qwen2-untied-linear", "documents", 3, True, False),
    "llama_lora": ("llama-tied-llama3", "concat", 2, False, True),
    "mixtral": ("mixtral-tied-hd", "documents", 3, False, False),
    "qwen2_rows2": ("qwen2-untied-linear", "concat", 1, False, False),
}
ROWS = {"qwen2_rows2": 2, "llama_sp2_dp2": 2}
"""Rows per micro-batch where not 1."""
AUX_COEFF = 0.1
"""Large, so a wrong share of the load-balancing loss shows in every gradient (the routers' most)."""


def _is_moe(variant: str) -> bool:
    from tests.helpers.zoo import VARIANTS
    from toolkit.adapters.moe import is_router_model
    return is_router_model(VARIANTS[variant].config())

def peft_reference(base: str, micro_batches: list[dict]) -> dict:
    """HF + peft on whole plain rows (``tests/helpers/lora.reference``): logits, adapter grads, the loss
    and the adapters' grad norm, as ``hf_reference`` gives them."""
    from tests.helpers.lora import reference
    from toolkit.loss import IGNORE_INDEX, token_loss_sum
    logits, grads = reference(base, micro_batches)
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    loss = sum(token_loss_sum(x, mb["labels"])[0].item() for x, mb in zip(logits, micro_batches)) / tokens
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    return {"logits": logits, "grads": grads, "loss": loss, "grad_norm": norm}


def global_rows(name: str, packing: str, dp: int) -> list[dict]:
    """The global batch of case ``name``: two micro-batches per DP replica."""
    return rows(packing, n=2 * dp, per_micro=ROWS.get(name, 1))


def _cases_rank(rank, world, bases, cases, sp=None):
    from toolkit.loss import IGNORE_INDEX
    out, sp = {}, sp or world
    for name, (variant, packing, stage, ckpt, lora) in cases.items():
        every = global_rows(name, packing, world // sp)
        tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in every)
        train = {"moe_aux_loss_coeff": AUX_COEFF} if _is_moe(variant) else {}
        train |= {"micro_batch_size": ROWS.get(name, 1), "global_batch_size": len(every) * ROWS.get(name, 1)}
        plan, engine = sp_engine(bases[variant], world, stage, packing, ckpt, sp=sp, lora=lora, train=train)
        place = deepspeed_place(engine)
        assert (engine.dp_rank, engine.dp_size, engine.seq.sp_rank) == place, (rank, place)
        micro = every[engine.dp_rank::engine.dp_size]  # this replica's rows, as the trainer deals them
        stats, logits, grads = observed_step(engine, micro, tokens)
        # fp32 at every stage (DeepSpeed's zero.Init made bf16 weights on CPU when given dtype=fp32)
        assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
        out[name] = {"loss": stats.loss, "grad_norm": stats.grad_norm, "logits": logits, "grads": grads, "extra": stats.extra,
                     "layout": engine.layout_record(), "local_tokens": [int((engine._labels(mb) != IGNORE_INDEX).sum())
                                                                         for mb in micro], "place": place}
        engine.engine.destroy()
    return out


def deepspeed_place(engine) -> tuple[int, int, int]:
    """(dp rank, dp size, sp rank) of this rank as DeepSpeed's own groups have it: its rank in its
    sequence-parallel group (``parallel_state_sp``), and as dp rank the index of that group among all
    of them (every rank's group gathered): the rows a replica takes are the rows its sp ranks split."""
    import torch.distributed as dist
    group = engine.seq.mpu.get_sequence_parallel_group()
    mine = dist.get_process_group_ranks(group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = sorted({tuple(g) for g in every})
    return groups.index(tuple(mine)), len(groups), dist.get_rank(group)


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    from tests.helpers.ranks import run_ranks
    root = tmp_path_factory.mktemp("ulysses")
    bases = {v: save_base(v, root / "bases") for v, *_ in CASES.values()}
    ranks = run_ranks(_cases_rank, 2, tmp_path_factory.mktemp("ulysses_ranks"), bases, CASES, timeout=600)
    return ranks, bases


SP4 = {"llama_sp4": ("llama-tied-llama3", "documents", 2, False, False)}
"""sp = 4 on 4 ranks (more ranks than cores only costs spinning): 4 query heads, one each, and 2 KV heads,
each replicated over 2 ranks by DeepSpeed's all-to-all; every rank a quarter of each row."""


@pytest.fixture(scope="module")
def sp4_runs(tmp_path_factory):
    from tests.helpers.ranks import run_ranks
    root = tmp_path_factory.mktemp("ulysses_sp4")
    bases = {v: save_base(v, root / "bases") for v, *_ in SP4.values()}
    return run_ranks(_cases_rank, 4, root, bases, SP4, timeout=600), bases


SP2_DP2 = {"llama_sp2_dp2": ("llama-tied-llama3", "documents", 3, False, False)}
"""sp = 2 x dp = 2 on 4 ranks: ranks {0, 1} split the rows of replica 0, {2, 3} those of replica 1;
ZeRO-3 partitions over all four and averages gradients over dp (``average_zero3_grads_over_dp``)."""


@pytest.fixture(scope="module")
def sp2_dp2_runs(tmp_path_factory):
    from tests.helpers.ranks import run_ranks
    root = tmp_path_factory.mktemp("ulysses_sp2_dp2")
    bases = {v: save_base(v, root / "bases") for v, *_ in SP2_DP2.values()}
    return run_ranks(_cases_rank, 4, root, bases, SP2_DP2, 2, timeout=600), bases


@pytest.mark.parametrize("case", sorted(CASES))
def test_sp2_equals_hf_on_each_document_alone(sp_runs, case):
    check_against_hf(*sp_runs, CASES, case)


def test_sp4_equals_hf_on_each_document_alone(sp4_runs):
    check_against_hf(*sp4_runs, SP4, "llama_sp4")


def test_sp2_dp2_equals_hf_on_the_global_batch(sp2_dp2_runs):
    """Each rank's (dp, sp) place is DeepSpeed's (ranks 0-1 replica 0, 2-3 replica 1), and the step
    over both replicas' rows equals HF's over the whole global batch."""
    ranks, _ = sp2_dp2_runs
    assert [r["llama_sp2_dp2"]["place"] for r in ranks] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    check_against_hf(*sp2_dp2_runs, SP2_DP2, "llama_sp2_dp2", sp=2)


def check_against_hf(ranks: list[dict], bases: dict, cases: dict, case: str, sp: int | None = None) -> None:
    from transformers import AutoModelForCausalLM
    variant, packing, *_ = cases[case]
    sp = sp or len(ranks)
    dp = len(ranks) // sp
    every = global_rows(case, packing, dp)
    got = [r[case] for r in ranks]
    assert got[0]["layout"] == {"dp": dp, "tp": 1, "pp": 1, "zero_stage": cases[case][2], "sp": sp}
    if packing == "documents":  # the slices of the rows hold uneven loss tokens
        assert len({str(g["local_tokens"]) for g in got}) > 1, [g["local_tokens"] for g in got]
    if cases[case][4]:
        ref = peft_reference(bases[variant], every)
    else:
        model = AutoModelForCausalLM.from_pretrained(bases[variant], dtype=torch.float32, attn_implementation="eager")
        ref = hf_reference(model, every, aux_coeff=AUX_COEFF if _is_moe(variant) else None)
    gaps = []  # the whole rows' logits: global micro-batch i is micro-batch i // dp of replica i % dp
    for i, want in enumerate(ref["logits"]):
        replica = got[(i % dp) * sp:(i % dp + 1) * sp]  # its sp ranks' slices, in sp order
        whole = torch.cat([g["logits"][i // dp] for g in replica], dim=1)
        real = ~want.isnan()
        gaps.append((whole[real] - want[real]).abs().max().item())
    ratios = grad_ratios(got[0]["grads"], ref["grads"])
    worst = max(ratios, key=ratios.get)
    print(f"\n{case}: logit gap {max(gaps):.2e}, loss {got[0]['loss']:.6f} vs {ref['loss']:.6f}, grad norm "
          f"{got[0]['grad_norm']:.6f} vs {ref['grad_norm']:.6f}, worst grad {ratios[worst]:.2e} ({worst})")
    assert max(gaps) < LOGIT_TOL
    for r in got:
        assert r["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=LOSS_RTOL)
    assert ratios[worst] < GRAD_RTOL, worst
    assert all(torch.equal(got[0]["grads"][n], g["grads"][n]) for g in got[1:] for n in got[0]["grads"])
    if "aux" in ref:  # the whole aux (not a rank's share), and each token's routing counted once
        print(f"{case}: aux {got[0]['extra']['moe_aux_loss']:.7f} vs {ref['aux']:.7f}, tokens per expert "
              f"{got[0]['extra']['moe_expert_tokens']}")
        for r in got:
            assert r["extra"]["moe_aux_loss"] == pytest.approx(ref["aux"], rel=LOSS_RTOL)
            assert r["extra"]["moe_expert_tokens"] == ref["expert_tokens"]


def _rows(run_dir):
    import json
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_sp2_checkpoint_resumes_at_sp1(tmp_path, data_cache):
    """``toolkit train`` at zero.sp=2 (2 ranks: its ZeRO checkpoint has 2 partitions) saves step 2 and
    goes on to step 3; the step-2 checkpoint resumed by one rank at sp=1 (converted to 1 partition,
    as any DP change) takes the same step 3: checkpoints do not depend on sp. The metrics count each
    token once (the same tokens per step at either sp)."""
    import shutil

    from tests.helpers.runs import resumes, train
    common = ("data.packing=documents", "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=3",
              "checkpoint.every=2", "train.export_hf=false")
    sp2 = tmp_path / "sp2"
    train(sp2, data_cache, *common, "zero.sp=2", nproc=2)
    resumed = tmp_path / "resumed"
    shutil.copytree(sp2, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    train(resumed, data_cache, *common, "zero.sp=1", nproc=1)
    assert [(ckpt, step, how) for ckpt, step, how in resumes(resumed)] == [("step_00000002", 2, "converted")]
    meta = (sp2 / "checkpoints" / "step_00000002" / "meta.json").read_text()
    assert '"sp": 2' in meta
    went_on = {r["step"]: r for r in _rows(sp2) if "loss" in r}
    again = [r for r in _rows(resumed) if r.get("step") == 3 and "loss" in r][-1]
    print(f"\nstep 3: sp=2 {went_on[3]['loss']:.7f}, resumed at sp=1 {again['loss']:.7f}")
    assert again["loss"] == pytest.approx(went_on[3]["loss"], rel=1e-5)
    assert again["grad_norm"] == pytest.approx(went_on[3]["grad_norm"], rel=1e-4)
    assert again["tokens"] == went_on[3]["tokens"] == 4 * 32
