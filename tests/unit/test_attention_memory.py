"""What the CPU attention of packed rows keeps for backward (``adapters/attention.py``, ``_by_spans``).

The bug these catch: sdpa given the memoized boolean ``[b, 1, s, s]`` document mask converts it to an
fp32 tensor per call and saves that for backward, so every layer of a packed micro-batch kept its own
``s x s`` fp32 mask (1 GiB per layer at 16k tokens) on every rank, under DP and zero.sp alike. Counted
with saved-tensor hooks: what autograd holds for backward, per storage. Exactness against HF's own model
run on each document alone is ``tests/unit/test_packing.py`` and ``tests/distributed/test_attention.py``.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.packing import micro_batch, packed, random_documents
from toolkit.adapters import hf_attention
from toolkit.adapters.attention import TokenLayout, attend
from toolkit.families.tiny import tiny_model


def _saved(run) -> list[torch.Tensor]:
    """The tensors autograd saves while ``run()`` runs (parameters and their views left out)."""
    saved = []

    def pack(t):
        if not isinstance(t._base if t._base is not None else t, torch.nn.Parameter):
            saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return saved


def _square(saved: list[torch.Tensor], s: int) -> dict[int, tuple]:
    """Storages of saved tensors whose last two dimensions are a span of the row (>= s / 2) squared:
    masks and scores. Storage pointer -> (shape, dtype, storage bytes)."""
    return {t.untyped_storage().data_ptr(): (tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
            for t in saved if t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] >= s // 2}


def test_hf_document_attention_on_cpu_saves_no_s_by_s_mask():
    """A tiny Llama (2 layers) on rows of 256 tokens packed with documents of 40-100 tokens: nothing of
    [s, s] (or a document's square) is saved, in any dtype; before, each layer saved an fp32
    [2, 1, 256, 256]."""
    model = hf_attention.use_document_attention(tiny_model("llama"))
    s = 256
    mb = micro_batch(packed(random_documents(12, seed=5, vocab=model.config.vocab_size, lengths=(40, 100)), s,
                            "documents"))
    assert mb["input_ids"].shape[1] == s and (mb["document_ids"].amax(dim=1) > 1).all()
    inputs = hf_attention.forward_inputs(mb)
    saved = _saved(lambda: model(**inputs).logits.sum().backward())
    squares = _square(saved, 40)
    assert squares == {}, f"saved for backward: {sorted(squares.values())}"
    assert not any(k[0] == "allowed" for k in inputs[hf_attention.LAYOUT_KWARG]._memo if isinstance(k, tuple))


@pytest.mark.parametrize("kernel_need", ["window", "softcap"])
def test_a_window_saves_one_band_shared_by_every_layer(kernel_need):
    """A sliding window shorter than a document: what a layer saves is a view of the micro-batch's one
    band mask (sdpa: additive, in the queries' dtype), the same storage in every layer, sized by the
    longest document; with a softcap the math path keeps each document's own scores only."""
    b, h, g, s, d = 2, 4, 2, 512, 16
    docs = torch.tensor([[1] * 300 + [2] * 212, [1] * 100 + [2] * 412])
    layout = TokenLayout.of(torch.zeros(b, s, dtype=torch.long), document_ids=docs)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, requires_grad=True) for n in (h, g, g))
    softcap = 2.0 if kernel_need == "softcap" else None
    saved = _saved(lambda: [attend(q, k, v, layout, window=64, scale=d ** -0.5, softcap=softcap) for _ in range(3)])
    squares = _square(saved, 64)
    if kernel_need == "window":
        assert len(squares) == 1  # one band for the three layers
        (shape, dtype, nbytes), = squares.values()
        assert dtype == torch.float32 and nbytes == 412 * 412 * 4
    else:  # scores and masks of one document at a time, never the whole row's
        assert squares and all(shape[-1] <= 412 for shape, _, _ in squares.values())
