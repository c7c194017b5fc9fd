"""The config zoo (``tests/helpers/zoo.py``) packed: each variant's documents packed in rows
(``data.packing=documents``) through HF's own model with the toolkit's document attention give, per
document, the logits of that document alone through HF's own sdpa forward, and the packed batch
gives the gradients of the same documents padded (as ``tests/unit/test_packing.py`` checks per family)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.packing import GRAD_RTOL, LOGITS_ATOL, micro_batch, packed, random_documents
from tests.helpers.zoo import VARIANTS, runs
from toolkit.adapters import hf_attention
from toolkit.engine import token_loss_sum

PACKED = runs("packing")


@pytest.mark.parametrize("variant", PACKED)
def test_each_packed_document_is_that_document_alone_and_grads_are_the_padded_ones(variant):
    assert PACKED[variant] == "documents"
    model = VARIANTS[variant].model()
    docs = random_documents(6, seed=2, vocab=model.config.vocab_size, lengths=(4, 15))
    with torch.no_grad():
        alone = {tuple(d[:-1].tolist()): model(input_ids=torch.from_numpy(d[:-1]).long()[None]).logits[0]
                 for d in docs}  # HF's own attention
    hf_attention.use_document_attention(model)
    grads, worst = {}, 0.0
    for mode in ("documents", "pad"):
        model.zero_grad()
        mb = micro_batch(packed(docs, 32, mode))
        inputs = hf_attention.forward_inputs(mb)
        logits = model(**inputs).logits
        hf_attention.check_applied(inputs)
        loss_sum, count = token_loss_sum(logits, mb["labels"])
        (loss_sum / count).backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if mode == "documents":
            assert (mb["document_ids"].amax(dim=1) > 1).any()  # a row holds several documents
            for row, ids, doc_ids in zip(logits.detach(), mb["input_ids"], mb["document_ids"]):
                for d in range(1, int(doc_ids.max()) + 1):
                    want = alone[tuple(ids[doc_ids == d].tolist())]
                    worst = max(worst, (row[doc_ids == d] - want).abs().max().item())
    grad_gap = max(((grads["documents"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
                   for n, g in grads["pad"].items())
    print(f"\n{variant}: packed vs alone max |logit diff| {worst:.2e}; packed vs padded worst grad {grad_gap:.2e}")
    assert grads["documents"].keys() == grads["pad"].keys()
    assert worst < LOGITS_ATOL and grad_gap < GRAD_RTOL
