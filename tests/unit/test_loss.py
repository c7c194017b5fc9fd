"""The chunked cross entropy (``toolkit.engine.token_loss_sum``) against the whole-tensor loss it
replaced: the same loss and the same per-token gradients, bit for bit, while fp32 exists only one
chunk of rows at a time.

Bugs these catch: a chunk boundary off by a row (targets of one row scored against another's
logits), the ignore mask dropped in the backward (ignored tokens get gradients), a gradient not cast
back as autograd casts it (bf16 rounding), a sum order that changes the loss, and a full fp32
[N, V] copy reintroduced (the memory test).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.loss import loss_allocations
from toolkit import device
from toolkit.engine import IGNORE_INDEX, LOSS_CHUNK_BYTES, loss_chunk_rows, token_loss_sum

VOCAB = 1009  # prime: divisible by nothing a kernel might vectorize over
BATCH, SEQ = 3, 37  # 111 rows: no chunk size below divides it


def reference_token_loss_sum(logits, labels):
    """The implementation before the chunked one (toolkit/engine.py until issue 18), kept as the reference."""
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


def _batch(dtype, seed=0, ignored=0.3):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(BATCH, SEQ, VOCAB, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[torch.rand(BATCH, SEQ, generator=gen) < ignored] = IGNORE_INDEX
    labels[0, :5] = IGNORE_INDEX  # a run of ignored rows at a chunk's start
    return logits, labels


def _loss_and_grad(fn, logits, labels, scale=0.37, **kw):
    """The loss and d(loss * scale)/d(logits), as the DeepSpeed adapter backpropagates it."""
    x = logits.detach().clone().requires_grad_(True)
    loss, count = fn(x, labels, **kw)
    (loss * scale).backward()
    return loss.detach(), count, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 110, 111, 4096])
def test_loss_and_gradients_equal_the_whole_tensor_loss_bit_for_bit(dtype, rows):
    logits, labels = _batch(dtype)
    ref_loss, ref_count, ref_grad = _loss_and_grad(reference_token_loss_sum, logits, labels)
    loss, count, grad = _loss_and_grad(token_loss_sum, logits, labels, chunk_rows=rows)
    assert loss.dtype == ref_loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
    assert torch.equal(grad, ref_grad), (grad - ref_grad).abs().max()
    assert count == ref_count
    assert not grad[labels == IGNORE_INDEX].any()  # an ignored token's logits get no gradient at all


@pytest.mark.parametrize("ignored", [0.0, 1.0])
def test_no_ignored_and_all_ignored_rows(ignored):
    logits, labels = _batch(torch.bfloat16, seed=1, ignored=ignored)
    if ignored == 0.0:
        labels[0, :5] = 7
    ref = _loss_and_grad(reference_token_loss_sum, logits, labels)
    ours = _loss_and_grad(token_loss_sum, logits, labels, chunk_rows=16)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_default_chunk_is_within_the_byte_budget_and_a_multiple_of_8():
    for vocab in (1009, 32000, 151936, 10**9):
        rows = loss_chunk_rows(vocab)
        assert rows % 8 == 0 and rows >= 8
        assert rows * vocab * 4 <= LOSS_CHUNK_BYTES or rows == 8
    assert loss_chunk_rows(151936) == 440  # Qwen3's vocabulary: 440 rows, 255 MiB of fp32


def test_default_chunking_and_non_contiguous_logits_in_eval():
    """[seq, batch, vocab] transposed to [batch, seq, vocab] (a view that is not contiguous), under
    no_grad as eval runs it."""
    logits, labels = _batch(torch.float32, seed=2)
    transposed = logits.transpose(0, 1).contiguous().transpose(0, 1)
    with torch.no_grad():
        assert torch.equal(token_loss_sum(transposed, labels)[0], reference_token_loss_sum(logits, labels)[0])
    ref = _loss_and_grad(reference_token_loss_sum, transposed, labels)
    ours = _loss_and_grad(token_loss_sum, transposed, labels, chunk_rows=8)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_out_of_range_labels_are_refused_as_before():
    logits, labels = _batch(torch.float32)
    labels[1, 3] = VOCAB
    with pytest.raises(IndexError, match="out of bounds"):
        reference_token_loss_sum(logits, labels)
    with pytest.raises(IndexError, match="out of bounds"):
        token_loss_sum(logits, labels, chunk_rows=8)


def test_strict_mode_refuses_host_labels():
    logits, labels = _batch(torch.float32)
    device.enable_strict()
    try:
        host = device.host_batch({"labels": labels.clone()})["labels"]
        with pytest.raises(device.DeviceError, match="labels is a host tensor"):
            token_loss_sum(logits, host)
        token_loss_sum(logits, device.to_device({"labels": host})["labels"])  # after the hand-off: fine
    finally:
        device.disable_strict()


def test_full_fp32_logits_never_exist():
    """bf16 logits [N, V]: the whole-tensor loss allocates fp32 [N, V] copies (upcast, log-softmax,
    its gradient: 3 at once); the chunked one never holds even one - its peak is the bf16 gradient
    (half an fp32 copy) plus a few chunks."""
    gen = torch.Generator().manual_seed(3)
    n, vocab, rows = 512, 4099, 64
    logits = torch.randn(n, vocab, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    full_fp32, chunk_fp32 = n * vocab * 4, rows * vocab * 4
    ref_peak, ref_largest = loss_allocations(reference_token_loss_sum, logits, labels)
    peak, largest = loss_allocations(token_loss_sum, logits, labels, chunk_rows=rows)
    print(f"peak live bytes: whole-tensor {ref_peak / full_fp32:.2f}, chunked {peak / full_fp32:.2f} "
          f"x one fp32 [N, V] copy; largest allocation {ref_largest / full_fp32:.2f} vs {largest / full_fp32:.2f}")
    assert ref_largest >= full_fp32 and ref_peak >= 3 * full_fp32  # the measurement sees the copies
    assert largest <= max(chunk_fp32, n * vocab * 2) + 4096  # bf16 gradient [N, V] or one fp32 chunk
    assert peak <= n * vocab * 2 + 3 * chunk_fp32 + 64 * 1024 < full_fp32
