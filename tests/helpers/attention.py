"""The plain attention reference (float64, the mask spelled out token by token) and the cases the CPU
and GPU attention tests compare the toolkit's kernels with."""
from __future__ import annotations

import torch

B, H, G, S, D = 2, 6, 2, 24, 16  # 3 query heads per KV group
DOCS = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [5] * 24])  # row 0: three documents; row 1: one


def reference_mask(docs: torch.Tensor | None, window: int | None, s: int = S) -> torch.Tensor:
    """[b, 1, s, s]: query i sees key j iff j <= i, same document, i - j < window; token by token."""
    rows = docs if docs is not None else torch.zeros(1, s, dtype=torch.long)
    mask = torch.zeros(rows.shape[0], 1, s, s, dtype=torch.bool)
    for b in range(rows.shape[0]):
        for i in range(s):
            for j in range(i + 1):
                mask[b, 0, i, j] = rows[b, i] == rows[b, j] and (window is None or i - j < window)
    return mask


def reference_attention(q, k, v, mask, scale, softcap=None):
    """Plain attention in float64: K/V repeated to every query head, scores, softcap, mask, softmax."""
    q, k, v = (x.double() for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def qkv(seed: int = 0, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, S, D), (B, G, S, D), (B, G, S, D))
    return [torch.randn(*shape, generator=g).requires_grad_(requires_grad) for shape in shapes]


CASES = {  # name: (documents, window, softcap)
    "causal": (None, None, None),
    "documents": (DOCS, None, None),
    "window": (None, 5, None),
    "documents_and_window": (DOCS, 5, None),
    "documents_some_within_the_window": (DOCS, 8, None),  # CPU: the 7-token documents need no band mask
    "softcap": (None, None, 2.0),
    "softcap_documents_window": (DOCS, 5, 2.0),
}
