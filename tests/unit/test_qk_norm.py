"""The full-width q/k RMSNorm (``LayerSpec.qk_norm = "full"``, OLMo 2) against HF's own
``Olmo2RMSNorm`` on one process; its TP form (sum of squares all-reduced over the TP group) is
checked against HF's model in ``test_megatron_parity.py`` (olmo2 at tp2)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from toolkit.families.base import LayerSpec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", ["q", "k"])
def test_full_width_norm_is_hf_s_norm_of_the_unsplit_projection(heads, dtype):
    """In fp32 and as a bf16 model holds it (bf16 weight and input; both compute in fp32, times the
    weight in fp32, cast back): the same bits."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from toolkit.adapters.megatron.qk_norm import FullWidthRMSNorm
    config = SimpleNamespace(num_attention_heads=4, num_query_groups=2)
    n_heads, d = (4 if heads == "q" else 2), 16
    mine = FullWidthRMSNorm(config, hidden_size=d, eps=1e-6, heads=heads, tp=1)
    ref = Olmo2RMSNorm(n_heads * d, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    weight = 1 + 0.1 * torch.randn(n_heads * d, generator=g)
    mine, ref = mine.to(dtype), ref.to(dtype)
    with torch.no_grad():
        mine.weight.copy_(weight), ref.weight.copy_(weight)
    x = torch.randn(5, 3, n_heads, d, generator=g) * torch.arange(1, n_heads + 1).view(1, 1, -1, 1)  # heads differ
    x = x.to(dtype)
    got = mine(x)
    want = ref(x.reshape(5, 3, -1)).reshape(x.shape)  # HF: [b, s, heads * d], normalized before the split
    assert mine.weight.shape == (n_heads * d,)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_full_width_norm_refuses_heads_that_do_not_split_over_tp():
    from toolkit.adapters.megatron.qk_norm import FullWidthRMSNorm
    config = SimpleNamespace(num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match="2 heads cannot split over tp=4"):
        FullWidthRMSNorm(config, hidden_size=16, heads="k", tp=4)


def test_layer_spec_refuses_an_unknown_qk_norm():
    with pytest.raises(ValueError, match=r"qk_norm='global'; choose one of \(None, 'head', 'full'\)"):
        LayerSpec(qk_norm="global")
