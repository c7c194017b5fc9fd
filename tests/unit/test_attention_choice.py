"""A model's attention softcap and sliding window never depend on the attention implementation
transformers picks (toolkit/adapters/hf.py): transformers 5.17 gives gemma2 ``sdpa``, which drops
the softcap (5.24 refuses sdpa for gemma2 and uses eager). The toolkit's HF model runs the
toolkit's attention for such configs, whichever implementation is asked for or defaulted to.

Reference: HF's own eager forward (which applies the softcap) with the same weights."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.adapters import hf
from toolkit.config import validate
from toolkit.families.tiny import tiny_config
from toolkit.plan import build_plan


@pytest.fixture
def gemma2_takes_sdpa(monkeypatch):
    """transformers 5.17's gemma2: sdpa accepted (and the default); a no-op on 5.17 itself."""
    from transformers.models.gemma2 import modeling_gemma2
    monkeypatch.setattr(modeling_gemma2.Gemma2PreTrainedModel, "_supports_sdpa", True)


def hf_logits(config, state: dict, ids: torch.Tensor, attention: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    model.load_state_dict(state)
    return model.eval()(input_ids=ids).logits.detach()


@torch.no_grad()
def test_gemma2_softcap_applies_when_sdpa_is_requested(gemma2_takes_sdpa):
    config = tiny_config("gemma2", attn_implementation="sdpa")
    assert config._attn_implementation == "sdpa"
    plan = build_plan(validate({"train": {"global_batch_size": 2, "micro_batch_size": 1, "seed": 3}}), [1],
                      hf_config=config)
    model = hf.build_model(plan).eval()
    for name, param in model.named_parameters():  # scores large enough for the cap to bite (HF's init: ~0.1)
        if "q_proj" in name or "k_proj" in name:
            param.mul_(6.0)
    state = model.state_dict()
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    got = model(input_ids=ids).logits
    capped = hf_logits(config, state, ids, "eager")
    uncapped = hf_logits(tiny_config("gemma2", attn_logit_softcapping=None), state, ids, "eager")
    try:  # the premise: transformers' sdpa cannot softcap
        sdpa = hf_logits(config, state, ids, "sdpa")
    except ValueError as exc:  # 5.24: it refuses
        assert "softcap" in str(exc)
    else:  # 5.17: it drops the softcap silently
        assert (sdpa - uncapped).abs().max() < 1e-5 < (sdpa - capped).abs().max()
    scale = capped.abs().max()
    assert (got - capped).abs().max() <= 2e-6 * scale, (got - capped).abs().max() / scale
    assert (got - uncapped).abs().max() > 1e-3 * scale
    assert model.config._attn_implementation != "sdpa"


@pytest.mark.parametrize("family", ["gemma2", "mistral", "phi3"])
def test_capped_or_windowed_models_run_the_toolkits_attention_as_hf_eager(family):
    """Every family with a softcap or a sliding window (windows of 6 in 24-token rows) runs the
    toolkit's attention on plain rows too; its logits and gradients are HF eager's."""
    config = tiny_config(family)
    plan = build_plan(validate({"train": {"global_batch_size": 2, "micro_batch_size": 1, "seed": 3}}), [1],
                      hf_config=config)
    model = hf.build_model(plan)
    assert model.config._attn_implementation == "toolkit_documents"
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = [m(input_ids=ids).logits for m in (model, reference)]
    scale = logits[1].abs().max().item()
    torch.testing.assert_close(logits[0], logits[1], atol=2e-6 * scale, rtol=0)  # measured <= 4.1e-7 * scale
    for out in logits:
        out.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max() <= 3e-6 * q.grad.abs().max() + 1e-12, name  # measured <= 7.1e-7
