"""Packed rows on the DeepSpeed path's HF models on the GPU (``pytest -m gpu``): the toolkit's document
attention there runs flex_attention with a block mask (forward and backward), which the CPU suite
cannot run. Each document of packed rows equals the document alone through HF's own model (sdpa), and
a packed batch gives the gradients of the same documents padded. fp32 with TF32 off.
``TOOLKIT_GPU_TESTS_ON_CPU=1`` rehearses both on the CPU (sdpa with a boolean mask there)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.gpu import DEVICE, GPU_ONLY
from tests.helpers.measure import measure
from tests.helpers.packing import micro_batch, packed, random_documents
from toolkit.adapters import hf_attention
from toolkit.adapters.attention import choose_kernel, flex_unavailable
from toolkit.engine import token_loss_sum
from toolkit.families.tiny import tiny_model

pytestmark = [*GPU_ONLY, pytest.mark.usefixtures("strict_fp32")]

def on_device(mb: dict) -> dict:
    return {k: v.to(DEVICE) for k, v in mb.items()}


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2_moe"])
def test_packed_documents_equal_alone_and_padded_grads_on_the_device(family):
    expected = "flex" if DEVICE == "cuda" else "sdpa"
    assert flex_unavailable(DEVICE) is None, f"compiled flex cannot run here: {flex_unavailable(DEVICE)}"
    assert choose_kernel("auto", DEVICE, masked=True, softcap=False, dropout=False) == expected
    docs = random_documents(8, seed=6, lengths=(5, 40))
    model = tiny_model(family).to(DEVICE)
    alone = {tuple(d[:-1].tolist()): model(input_ids=torch.from_numpy(d[:-1]).long()[None].to(DEVICE)).logits[0]
             for d in docs}
    grads, worst = {}, 0.0
    for mode in ("documents", "pad"):
        model = hf_attention.use_document_attention(tiny_model(family).to(DEVICE))
        mb = on_device(micro_batch(packed(docs, 64, mode)))
        inputs = hf_attention.forward_inputs(mb)
        logits = model(**inputs).logits
        hf_attention.check_applied(inputs)
        for row, ids, doc_ids in zip(logits, mb["input_ids"], mb["document_ids"]):
            for d in range(1, int(doc_ids.max()) + 1):
                want = alone[tuple(ids[doc_ids == d].tolist())]
                worst = max(worst, (row[doc_ids == d] - want).abs().max().item())
        loss_sum, count = token_loss_sum(logits, mb["labels"])
        (loss_sum / count).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    gap = max(((grads["documents"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
              for n, g in grads["pad"].items())
    measure(f"{expected}: logits packed vs alone, max abs", worst, 1e-4)
    measure(f"{expected}: grads packed vs padded, max rel", gap, 1e-4)
    assert worst < 1e-4 and gap < 1e-4
