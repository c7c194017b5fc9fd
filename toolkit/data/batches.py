"""Global batches by (seed, step), split into this rank's micro-batches, read from Arrow in one call."""
from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import TYPE_CHECKING

import datasets
import numpy as np
import torch

from toolkit.device import host_batch

if TYPE_CHECKING:
    from toolkit.data.base import PackedData


def batch_indices(data: "PackedData", global_batch_size: int, seed: int, step: int) -> list[int]:
    """Rows of ``data.train`` in global batch ``step``: ``global_batch_indices`` for one source, the blend's
    rule for several (``data.weights``). A function of (data, seed, step) alone, whatever the layout."""
    if data.blend is not None:
        return data.blend.global_batch(step, global_batch_size)
    return global_batch_indices(len(data.train), global_batch_size, seed, step)


def tokens_by_source(data: "PackedData", indices: list[int]) -> dict[str, int] | None:
    """A blend's document tokens (not padding) per source in these rows; None for one source."""
    if data.blend is None:
        return None
    source = data.blend.source_of(indices)
    return {name: batch_counts(data.train, [i for i, s in zip(indices, source) if s == d])["tokens"]
            for d, name in enumerate(data.blend.names)}


def global_batch_indices(num_samples: int, global_batch_size: int, seed: int, step: int) -> list[int]:
    """Sample indices of global batch ``step`` (0-based), ``global_batch_size`` of them.

    The order is the endless concatenation of per-epoch permutations (epoch ``e`` permuted by a
    ``torch.Generator`` seeded from (seed, e)); batch k is positions [k*G, (k+1)*G) of that stream,
    so a batch may straddle an epoch boundary. Depends on nothing else: not DP size, not
    micro-batch size, not earlier steps."""
    if num_samples < 1 or global_batch_size < 1 or step < 0:
        raise ValueError(f"need num_samples>=1, global_batch_size>=1, step>=0; got {num_samples}, "
                         f"{global_batch_size}, {step}")
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size)
    epochs, offsets = np.divmod(positions, num_samples)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        out[in_epoch] = _epoch_permutation(num_samples, seed, int(epoch))[offsets[in_epoch]]
    return out.tolist()


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """``[num_samples]`` permutation of epoch ``epoch``; cached because consecutive steps share it."""
    mixed = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()  # independent streams per epoch
    gen = torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") & (2**63 - 1))
    perm = torch.randperm(num_samples, generator=gen).numpy()
    perm.flags.writeable = False
    return perm


def rank_micro_batches(ds: datasets.Dataset, indices: list[int], dp_rank: int, dp_size: int,
                       micro_batch_size: int, images=None) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of a global batch: rank r takes the r-th contiguous slice of
    ``indices`` (``len(indices) / dp_size`` samples), split in order into micro-batches, each
    ``{"input_ids": LongTensor [mbs, seq_len], "labels": LongTensor [mbs, seq_len]}``; ``images``: a
    vision-language model's ``data.vision.VisionBatches``, which adds each micro-batch's pixels."""
    per_rank, rest = divmod(len(indices), dp_size)
    if rest or per_rank % micro_batch_size or not 0 <= dp_rank < dp_size:
        raise ValueError(f"{len(indices)} indices cannot be split over dp_size={dp_size} ranks "
                         f"(dp_rank={dp_rank}) in micro-batches of {micro_batch_size}; the global batch "
                         "size must be a multiple of micro_batch_size x dp")
    return _fetch(ds, indices[dp_rank * per_rank:(dp_rank + 1) * per_rank], micro_batch_size, images)


def _fetch(ds: datasets.Dataset, indices: list[int], micro_batch_size: int,
           images=None) -> list[dict[str, torch.Tensor]]:
    """One Arrow ``take`` for all of this rank's rows, then views per micro-batch; rows packed by
    documents carry ``document_ids`` too (the engines derive positions and masks from them)."""
    if not len(indices):
        return []
    columns = [c for c in ("input_ids", "labels", "document_ids") if c in ds.column_names]
    rows = ds.with_format("numpy", columns=columns)[[int(i) for i in indices]]
    tensors = {c: torch.from_numpy(np.ascontiguousarray(rows[c], dtype=np.int64)) for c in columns}
    refs = ds.select_columns(["images", "image_tokens"])[[int(i) for i in indices]] if images else None

    def pixels(i: int) -> dict:  # a vision-language model's images of these rows, made now (never cached)
        cut = slice(i, i + micro_batch_size)
        return images.pixels(refs["images"][cut], refs["image_tokens"][cut]) if images else {}
    return [host_batch({c: t[i:i + micro_batch_size] for c, t in tensors.items()} | pixels(i))
            for i in range(0, len(indices), micro_batch_size)]


def count_loss_tokens(ds: datasets.Dataset, indices: list[int]) -> int:
    """Labels != -100 over these samples, from the ``num_loss_tokens`` column (no token reads);
    the trainer divides the summed loss of a global batch by this on every rank."""
    return batch_counts(ds, indices)["loss_tokens"]


def batch_counts(ds: datasets.Dataset, indices: list[int]) -> dict[str, int]:
    """``loss_tokens``, ``tokens`` (not padding), ``documents`` (pieces; None for ``concat``
    rows, which do not record where documents start) and ``pairs`` (preference pairs, whole in their
    rows; None for other data) over these samples, from the per-row count columns (no token reads)."""
    has_docs = "num_documents" in ds.column_names
    has_pairs = "num_pairs" in ds.column_names
    if not len(indices):
        return {"loss_tokens": 0, "tokens": 0, "documents": 0, "pairs": 0 if has_pairs else None}
    columns = ["num_loss_tokens"] + (["num_tokens", "num_documents"] if has_docs else []) + \
        (["num_pairs"] if has_pairs else [])
    rows = ds.with_format("numpy", columns=columns)[[int(i) for i in indices]]
    seq_len = ds.features["input_ids"].length
    return {"loss_tokens": int(rows["num_loss_tokens"].sum()),
            "tokens": int(rows["num_tokens"].sum()) if has_docs else len(indices) * seq_len,
            "documents": int(rows["num_documents"].sum()) if has_docs else None,
            "pairs": int(rows["num_pairs"].sum()) if has_pairs else None}


def eval_micro_batches(ds: datasets.Dataset | None, dp_rank: int, dp_size: int, micro_batch_size: int,
                       max_batches: int, images=None) -> list[dict[str, torch.Tensor]]:
    """Up to ``max_batches`` micro-batches per rank from the first samples of ``ds`` in fixed
    order, sliced across ranks like ``rank_micro_batches``. Only full micro-batches on every rank
    are used (all ranks must run the same number of equal-shaped forwards), so a set smaller than
    ``dp_size * micro_batch_size`` gives []; ``prepare_data`` keeps at least a global batch."""
    if ds is None:
        return []
    per_step = dp_size * micro_batch_size
    n = min(len(ds), max_batches * per_step) // per_step * per_step
    return rank_micro_batches(ds, list(range(n)), dp_rank, dp_size, micro_batch_size, images)
