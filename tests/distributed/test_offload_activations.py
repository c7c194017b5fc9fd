"""``zero.offload_activations`` through the DeepSpeed engine on 2 gloo ranks: one step with the option on
equals the step with it off (loss, grad norm, every parameter's whole gradient at the accumulation
boundary, bit for bit), and torch's ``save_on_cpu`` took exactly one [micro-batch, seq_len / sp,
hidden] input per checkpointed layer and micro-batch (``tests/helpers/offload.py``), none when off.

- llama, ZeRO-2, dp=2;
- qwen2 (attention biases, untied), ZeRO-3 with Ulysses zero.sp=2 (each rank half of every row).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.offload import expected_bytes, host_saves
from tests.helpers.ulysses import observed_step, rows, sp_engine
from tests.helpers.zoo import save_base

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

CASES = {  # name: (zoo variant, ZeRO stage, zero.sp)
    "llama_zero2": ("llama-tied-llama3", 2, 1),
    "qwen2_zero3_sp2": ("qwen2-untied-linear", 3, 2),
}


def _step(base, world, stage, sp, offload):
    from toolkit.loss import IGNORE_INDEX
    micro = rows("documents")
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
    plan, engine = sp_engine(base, world, stage, "documents", True, sp=sp,
                             zero={"stage": stage, "sp": sp, "offload_activations": offload})
    with host_saves() as seen:
        stats, _, grads = observed_step(engine, micro, tokens)
    engine.engine.destroy()
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "grads": grads, "saved": seen,
            "expected": expected_bytes(plan.config, plan.model.hf_config(), len(micro), sp)}


def _rank(rank, world, bases):
    return {name: {offload: _step(bases[variant], world, stage, sp, offload) for offload in (False, True)}
            for name, (variant, stage, sp) in CASES.items()}


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    from tests.helpers.ranks import run_ranks
    root = tmp_path_factory.mktemp("offload")
    bases = {v: save_base(v, root / "bases") for v, *_ in CASES.values()}
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("offload_ranks"), bases, timeout=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_offloaded_step_equals_the_step_on_the_device(offload_runs, case):
    for r in offload_runs:
        off, on = r[case][False], r[case][True]
        assert (on["loss"], on["grad_norm"]) == (off["loss"], off["grad_norm"])
        assert sorted(on["grads"]) == sorted(off["grads"])
        unequal = [n for n, g in off["grads"].items() if not torch.equal(g, on["grads"][n])]
        assert not unequal, unequal


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_checkpointed_layer_input_and_nothing_else_went_to_the_host(offload_runs, case):
    for r in offload_runs:
        off, on = r[case][False], r[case][True]
        assert off["saved"] == []
        moved = sum(b for _, _, b in on["saved"])
        print(f"\n{case}: {len(on['saved'])} tensors, {moved} bytes to the host per step "
              f"(expected {on['expected']}); shapes {sorted({s for s, _, _ in on['saved']})}")
        assert moved == on["expected"]
        assert {dtype for _, dtype, _ in on["saved"]} == {torch.float32}
