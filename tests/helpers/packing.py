"""Packed rows of random documents, as the packing tests on the HF path, the zoo and the GPU build
them, and the tolerances of their comparisons with the documents alone or padded."""
from __future__ import annotations

import numpy as np
import torch

from toolkit.data.pack import pack_documents

LOGITS_ATOL = 2e-6  # measured max 3.9e-7 (gemma2 softcaps), 2.4e-7 (qwen2_moe); a leaked document: > 1e-2
GRAD_RTOL = 1e-5  # per parameter, max |diff| / max |grad|: measured max 6e-7


def random_documents(n: int, seed: int, vocab: int = 250, lengths=(3, 20)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, rng.integers(*lengths)).astype(np.int32) for _ in range(n)]


def packed(docs: list[np.ndarray], seq_len: int, mode: str, overflow: str = "split", loss=None) -> dict:
    ids = np.concatenate(docs)
    loss = np.ones_like(ids, dtype=np.int8) if loss is None else loss
    return pack_documents(ids, loss, np.array([len(d) for d in docs]), seq_len, mode, overflow)


def micro_batch(rows: dict) -> dict:
    return {k: torch.from_numpy(rows[k]).long() for k in ("input_ids", "labels", "document_ids")}
