"""Tiny seeded HF models of every family, for tests and benchmarks: each family file's ``TINY``
config (a few layers, hidden 64, shaped to exercise the family's quirks: GQA, biases, tying, a
vocabulary of 250 that is not a multiple of 128 * tp). A family added with a ``TINY`` is tested by
every test parametrized over ``TINY`` / ``TINY_MOE``."""
from __future__ import annotations

import torch

from toolkit.families import family_modules


def _tiny_configs(moe: bool) -> dict[str, dict]:
    return {t: dict(m.TINY) for t, m in sorted(family_modules().items())
            if hasattr(m, "TINY") and bool(m.FAMILY.num_experts_field) == moe}


TINY = _tiny_configs(moe=False)
"""model_type -> tiny config keyword arguments (``model_type`` included), dense families."""
TINY_MOE = _tiny_configs(moe=True)
"""The same for mixture-of-experts families (4 experts, top-2)."""


def tiny_config(family: str, **changes):
    from transformers import AutoConfig
    kw = {**{**TINY, **TINY_MOE}[family], **changes}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def tiny_model(family: str, seed: int = 0, **changes):
    """A tiny seeded HF model of any family above (dense or mixture of experts), in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    config = tiny_config(family, **changes)
    # HF's eager applies an attention softcap; transformers 5.17 would pick sdpa for gemma2, which drops it
    choice = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False, **choice)
    with torch.no_grad():  # HF inits biases and norms to constants: randomize so mix-ups show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()
