"""Megatron bf16 against HF's own bf16 model (llama; gemma's (1 + w) norms and embedding scale;
gemma2's post-norms and softcaps), one gloo rank: logits and per-parameter gradients, and megatron's
mixed-precision convention (``Float16Module``): every parameter, norms included, in bf16 with an fp32
master in the distributed optimizer, and bf16 activations out of every norm.

With megatron-core's default, fp32 norm weights (torch 2.13 on the CPU runs such a norm unfused and
still rounds its output to bf16), the logits differed from HF's bf16 by 0.0096 / 0.0053 / 0.0182 of
the largest logit (llama / gemma / gemma2), against 0.0087 / 0.0053 / 0.0121 with bf16 norms: only
gemma2 (four norms a layer) fails the parity bound, so the parameter dtypes are asserted directly.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import batches, grad_gap, grad_mismatches, hf_reference, worst_ratio
from tests.helpers.ranks import run_ranks
from toolkit.config import validate
from toolkit.families.tiny import tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo parity suite")

FAMILIES = ["gemma", "gemma2", "llama"]
LOGIT_RTOL = 0.015
"""max |megatron - HF| over max |HF logit|, both bf16: measured 0.0087 (llama), 0.0053 (gemma),
0.0121 (gemma2): 1-3 bf16 rounding steps of the largest logit (HF bf16 is 0.0089 / 0.0029 / 0.017
from HF fp32). fp32 norm weights: gemma2 0.0182."""
GRAD_RTOL = 0.04
"""Per parameter, max |megatron - HF| over max |HF grad| of that parameter, both bf16 (megatron's
accumulated in fp32): measured worst 0.0185 (llama), 0.0163 (gemma), 0.0181 (gemma2)."""


def _rank_bf16(rank, world):
    from tests.helpers.ranks import megatron_engine, release_megatron
    out = {}
    for family in FAMILIES:
        model = tiny_model(family)
        micro = batches(model.config.vocab_size, n_micro=2)
        _, _, tokens = hf_reference(model, micro)
        hf_logits, hf_grads, _ = hf_reference(tiny_model(family).to(torch.bfloat16), micro)
        cfg = validate({"backend": "megatron", "model": {"dtype": "bf16"},
                        "train": {"global_batch_size": 2, "micro_batch_size": 1}})
        engine = megatron_engine(cfg, model)
        norm_outputs = _record_norm_outputs(engine)
        logits = engine.logits(micro)
        engine.forward_backward(micro, tokens, complete_grads=True)
        grads = engine.hf_state(attr="main_grad")
        out[family] = {
            "logits": max((a - b.float()).abs().max().item() / b.float().abs().max().item()
                          for a, b in zip(logits, hf_logits)),
            "grads": {n: grad_gap(grads[n].float(), g.float()) for n, g in hf_grads.items()},
            "param_dtypes": {n: p.dtype for c in engine.model for n, p in c.module.named_parameters()},
            "master_dtypes": _master_dtypes(engine),
            "norm_outputs": norm_outputs}
        release_megatron()
    return out


def _record_norm_outputs(engine) -> dict[str, torch.dtype]:
    """{norm module name: dtype of its output}, filled by the next forward."""
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen.setdefault(name, output.dtype)
        return hook

    for chunk in engine.model:
        for name, module in chunk.module.named_modules():
            if type(module).__name__.endswith("Norm"):  # RMSNorm, LayerNorm, ZeroCenteredRMSNorm
                module.register_forward_hook(record(name))
    return seen


def _master_dtypes(engine) -> dict[str, tuple[torch.dtype, bool]]:
    """{parameter: (dtype of the distributed optimizer's main copy, whether it is a copy of its own)}."""
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    out = {}
    for chunk in engine.model:
        for name, param in chunk.module.named_parameters():
            for holder in (o for o in optimizers if param in o.model_param_group_index_map):
                main = holder._get_main_param_and_optimizer_states(param)["param"]
                out[name] = (main.dtype, main.untyped_storage().data_ptr() != param.untyped_storage().data_ptr())
    return out


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    result = run_ranks(_rank_bf16, 1, tmp_path_factory.mktemp("bf16"), timeout=900)[0]
    for family, d in result.items():
        print(f"\nmegatron bf16 vs HF bf16, {family}: logits {d['logits']:.4f} of max |logit|, "
              f"grads {worst_ratio(d['grads'])}")
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_in_bf16_with_an_fp32_master(bf16, family):
    d = bf16[family]
    assert {n: t for n, t in d["param_dtypes"].items() if t != torch.bfloat16} == {}
    assert sorted(d["master_dtypes"]) == sorted(d["param_dtypes"])
    assert {n: m for n, m in d["master_dtypes"].items() if m != (torch.float32, True)} == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_norm_outputs_bf16(bf16, family):
    norms = bf16[family]["norm_outputs"]
    assert len(norms) >= 2 * 4 + 1  # two per layer and the final one at least
    assert {n: t for n, t in norms.items() if t != torch.bfloat16} == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_and_gradients_match_hfs_bf16(bf16, family):
    d = bf16[family]
    assert d["logits"] < LOGIT_RTOL
    assert not grad_mismatches(d["grads"], GRAD_RTOL), worst_ratio(d["grads"])
