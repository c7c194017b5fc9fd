"""Packing tokenized documents into samples, the cached pipeline (``prepare_data``), the eval split."""
from __future__ import annotations

import bisect
import hashlib
import json
import math
from typing import TYPE_CHECKING, Any, Callable

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from toolkit.config import RunConfig
from toolkit.data.base import (
    _PIPELINE_VERSION,
    _PREFERENCE_RECIPE,
    CHAT_HEADERS,
    INSTRUCTION_TEMPLATE,
    PACK_BATCH_DOCS,
    DataError,
    PackedData,
    data_cache_dir,
)
from toolkit.data.sources import check_rows, load_source, required_columns
from toolkit.data.templates import preference_tokenize_fn, tokenize_fn
from toolkit.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pack_tokens(ids: np.ndarray, loss: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Cut one token stream ``ids`` [T] (with ``loss`` [T] in {0, 1}) into samples.

    Returns ``input_ids`` [n, seq_len], ``labels`` [n, seq_len] (target token, or -100 where it
    carries no loss) and ``num_loss_tokens`` [n], for windows ``ids[k*seq_len : (k+1)*seq_len + 1]``;
    windows without any loss token are left out."""
    n = max(0, (len(ids) - 1) // seq_len)
    inputs = ids[:n * seq_len].reshape(n, seq_len)
    targets = ids[1:n * seq_len + 1].reshape(n, seq_len)
    mask = loss[1:n * seq_len + 1].reshape(n, seq_len).astype(bool)
    labels = np.where(mask, targets, IGNORE_INDEX).astype(np.int32)
    num_loss = mask.sum(axis=1).astype(np.int32)
    keep = num_loss > 0
    return {"input_ids": inputs[keep].astype(np.int32), "labels": labels[keep], "num_loss_tokens": num_loss[keep]}


def document_pieces(lengths: np.ndarray, seq_len: int, overflow: str) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) ``[n]`` of the pieces documents of ``lengths`` [D] tokens become, in the flat
    stream of their inputs (a document of T tokens has T - 1 input/target pairs): a document of at
    most ``seq_len`` pairs is one piece; a longer one is cut into ``seq_len`` pieces (``split``) or
    left out (``drop``). Documents without pairs (a lone EOS) give nothing."""
    pairs = np.maximum(lengths.astype(np.int64) - 1, 0)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]])
    keep = (pairs > 0) & ((pairs <= seq_len) | (overflow == "split"))
    pairs, starts = pairs[keep], starts[keep]
    count = -(-pairs // seq_len)  # pieces per document
    first = np.repeat(np.cumsum(count) - count, count)
    k = np.arange(count.sum()) - first  # piece number inside its document
    piece_start = np.repeat(starts, count) + k * seq_len
    piece_len = np.minimum(np.repeat(pairs, count) - k * seq_len, seq_len)
    return piece_start, piece_len


def fit_rows(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Pieces of ``lengths`` (each <= seq_len) grouped into rows of at most ``seq_len`` tokens, best
    fit in decreasing length (a piece goes to the fullest row it fits in; ties by index, so the
    result is deterministic). Rows are listed by creation, pieces inside a row in placement order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted
    for piece in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        need = int(lengths[piece])
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            rows.append([piece])
            space, row = seq_len - need, len(rows) - 1
        else:
            space, row = free.pop(at)
            rows[row].append(piece)
            space -= need
        if space > 0:
            bisect.insort(free, (space, row))
    return rows


def pack_documents(ids: np.ndarray, loss: np.ndarray, lengths: np.ndarray, seq_len: int, mode: str,
                   overflow: str) -> dict[str, np.ndarray]:
    """Whole documents into rows (``documents``: several per row, ``fit_rows``; ``pad``: one per row).

    ``ids``/``loss`` [T]: the documents' tokens back to back, ``lengths`` [D] their lengths. Each
    document (or ``split`` piece) gives inputs ``doc[:-1]`` and targets ``doc[1:]`` (-100 where the
    target carries no loss), so no token predicts across a boundary. Returns ``input_ids``,
    ``labels``, ``document_ids`` (1, 2, ... per piece in the row, 0 on the padded tail; input 0
    there) ``[n, seq_len]`` and per row ``num_loss_tokens``, ``num_tokens`` (not padding) and
    ``num_documents``. Pieces and rows without a loss token are left out."""
    targets = _targets(ids, loss)
    start, length = document_pieces(lengths, seq_len, overflow)
    has_loss = np.cumsum(np.append(0, targets != IGNORE_INDEX))
    useful = has_loss[start + length] - has_loss[start] > 0
    start, length = start[useful], length[useful]
    rows = fit_rows(length, seq_len) if mode == "documents" else [[i] for i in range(len(length))]
    return _with_counts(_gather_rows(ids, targets, start, length, rows, seq_len), rows)


def _targets(ids: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """``[T]``: the token each position predicts (``ids[t + 1]``), -100 where it carries no loss."""
    targets = np.where(loss[1:].astype(bool), ids[1:], IGNORE_INDEX)
    return np.append(targets, IGNORE_INDEX).astype(np.int32)  # position T-1 is never an input


def _with_counts(out: dict[str, np.ndarray], rows: list[list[int]]) -> dict[str, np.ndarray]:
    """Add the per-row counts ``num_loss_tokens``, ``num_tokens`` (not padding), ``num_documents``."""
    out["num_loss_tokens"] = (out["labels"] != IGNORE_INDEX).sum(axis=1).astype(np.int32)
    out["num_tokens"] = (out["document_ids"] > 0).sum(axis=1).astype(np.int32)
    out["num_documents"] = np.array([len(r) for r in rows], dtype=np.int32)
    return out


def pack_pairs(ids: np.ndarray, loss: np.ndarray, lengths: np.ndarray, seq_len: int,
               mode: str) -> dict[str, np.ndarray]:
    """Whole preference pairs into rows (``documents``: several per row, best fit by the pair's
    length, ``fit_rows``; ``pad``: one pair per row); a pair is never split across rows.

    ``lengths`` [2P]: documents ``2p`` (prompt + chosen) and ``2p + 1`` (prompt + rejected) of pair
    ``p``, their tokens back to back in ``ids``/``loss`` [T]. Each document gives inputs ``doc[:-1]``
    and targets ``doc[1:]`` as ``pack_documents`` makes them; pair ``j`` of a row (1-based) holds
    document ``2j - 1`` (chosen) then ``2j`` (rejected) in ``document_ids``. A pair with more than
    ``seq_len`` inputs in all, or with a document without a loss token, is left out. Returns the
    columns of ``pack_documents`` and ``num_pairs`` per row."""
    if len(lengths) % 2:
        raise ValueError(f"pack_pairs takes documents in pairs; got {len(lengths)}")
    targets = _targets(ids, loss)
    start = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]).astype(np.int64)
    length = np.maximum(lengths.astype(np.int64) - 1, 0)
    has_loss = np.cumsum(np.append(0, targets != IGNORE_INDEX))
    useful = (has_loss[start + length] - has_loss[start] > 0).reshape(-1, 2).all(axis=1)
    pair_len = length.reshape(-1, 2).sum(axis=1)
    kept = np.flatnonzero(useful & (pair_len <= seq_len))
    groups = fit_rows(pair_len[kept], seq_len) if mode == "documents" else [[i] for i in range(len(kept))]
    docs = np.stack([2 * kept, 2 * kept + 1], axis=1).reshape(-1)  # kept pair i -> documents 2i, 2i + 1
    rows = [[2 * i + side for i in group for side in (0, 1)] for group in groups]
    out = _with_counts(_gather_rows(ids, targets, start[docs], length[docs], rows, seq_len), rows)
    out["num_pairs"] = np.array([len(g) for g in groups], dtype=np.int32)
    return out


def _gather_rows(ids: np.ndarray, targets: np.ndarray, start: np.ndarray, length: np.ndarray,
                 rows: list[list[int]], seq_len: int) -> dict[str, np.ndarray]:
    """``input_ids``, ``labels``, ``document_ids`` ``[len(rows), seq_len]``: piece ``p`` (tokens
    ``start[p] : start[p] + length[p]`` of ``ids``/``targets``) placed after its row's earlier
    pieces, in one vectorized gather (no per-token Python)."""
    if not rows:
        return {k: np.zeros((0, seq_len), np.int32) for k in ("input_ids", "labels", "document_ids")}
    order = np.array([p for row in rows for p in row], dtype=np.int64)  # pieces row after row
    per_row = np.array([len(r) for r in rows], dtype=np.int64)
    row_of = np.repeat(np.arange(len(rows)), per_row)
    slot = np.arange(len(order)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    plen = length[order]
    before = np.cumsum(plen) - plen  # start of each piece in all pieces back to back
    row_tokens = np.bincount(row_of, weights=plen, minlength=len(rows)).astype(np.int64)
    in_row = before - np.repeat(np.cumsum(row_tokens) - row_tokens, per_row)
    t = np.arange(int(plen.sum())) - np.repeat(before, plen)  # token index inside its piece
    src = np.repeat(start[order], plen) + t
    dst = np.repeat(row_of * seq_len + in_row, plen) + t
    out = {"input_ids": np.zeros(len(rows) * seq_len, np.int32),
           "labels": np.full(len(rows) * seq_len, IGNORE_INDEX, np.int32),
           "document_ids": np.zeros(len(rows) * seq_len, np.int32)}
    out["input_ids"][dst] = ids[src]
    out["labels"][dst] = targets[src]
    out["document_ids"][dst] = np.repeat(slot + 1, plen)
    return {k: v.reshape(len(rows), seq_len) for k, v in out.items()}


def _pack_fn(seq_len: int, mode: str, overflow: str, pairs: bool = False) -> Callable[[pa.Table], dict]:
    """Batched map function over Arrow batches of tokenized documents (flattened without copies);
    ``pairs``: the documents come two per preference pair (batches hold whole pairs: even sizes)."""
    def pack(batch: pa.Table) -> dict:
        column = batch.column("ids").combine_chunks()
        ids = column.flatten().to_numpy(zero_copy_only=False)
        loss = batch.column("loss").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        return _pack_batch(ids, loss, lengths, seq_len, mode, overflow, pairs)
    return pack


def _pack_batch(ids: np.ndarray, loss: np.ndarray, lengths: np.ndarray, seq_len: int, mode: str, overflow: str,
                pairs: bool = False) -> dict[str, np.ndarray]:
    """The rows of one pack batch of documents (``lengths`` [D], their tokens back to back in ``ids``/``loss``),
    whatever they were read from (Arrow here, a Megatron prefix in ``indexed_rows``)."""
    if mode == "concat":
        return pack_tokens(ids, loss, seq_len)
    if pairs:
        return pack_pairs(ids, loss, lengths, seq_len, mode)
    return pack_documents(ids, loss, lengths, seq_len, mode, overflow)


def _packed_features(seq_len: int, mode: str, pairs: bool = False) -> datasets.Features:
    row = datasets.List(datasets.Value("int32"), length=seq_len)
    features = {"input_ids": row, "labels": row, "num_loss_tokens": datasets.Value("int32")}
    if mode != "concat":
        features |= {"document_ids": row, "num_tokens": datasets.Value("int32"),
                     "num_documents": datasets.Value("int32")}
    if pairs:
        features["num_pairs"] = datasets.Value("int32")
    return datasets.Features(features)


# --- prepare -------------------------------------------------------------------------------------

def prepare_source(cfg: RunConfig, tokenizer: "PreTrainedTokenizerBase") -> PackedData:
    """Load ``data.path``, check it, tokenize, pack and split off eval; cached in ``data.cache_dir``.

    Raises DataError before any training for a missing source or column, an empty source, non-text
    values, or fewer packed train samples than ``train.global_batch_size``. Sources ``datasets`` reads
    (files, save_to_disk, hub); ``load.prepare_data`` dispatches Megatron prefixes and blends."""
    source = load_source(cfg)
    check_rows(source, cfg)
    source = source.select_columns(list(required_columns(cfg).values()))
    docs = _tokenize(source, cfg, tokenizer)
    if cfg.data.template == "preference" and len(docs) == 0:
        _no_pair_differs(cfg, len(source))
    packed = _pack(docs, cfg)
    lengths = pc.list_value_length(docs.data.column("ids"))
    num_tokens = int(pc.sum(lengths).as_py() or 0)
    if cfg.data.template == "preference":  # pairs with more than seq_len input/target positions
        inputs = np.maximum(lengths.to_numpy(zero_copy_only=False).astype(np.int64) - 1, 0)
        overflow = int((inputs.reshape(-1, 2).sum(axis=1) > cfg.data.seq_len).sum())
    else:
        overflow = 0 if cfg.data.packing_mode == "concat" else \
            int(pc.sum(pc.greater(lengths, cfg.data.seq_len + 1)).as_py() or 0)  # > seq_len input/target pairs
    pairs = len(source) if cfg.data.template == "preference" else None  # each row is a pair
    identical = pairs - len(docs) // 2 if pairs else 0  # pairs tokenized to no documents (templates.py)
    train, evals = _split_eval(packed, cfg)
    _check_enough(train, evals, num_tokens, len(docs), cfg, dropped_pairs=overflow if pairs else 0)
    return PackedData(train=train, eval=evals, num_tokens=num_tokens, num_documents=len(docs),
                      packing=cfg.data.packing_mode, num_overflow=overflow, num_pairs=pairs,
                      num_identical_pairs=identical)


def _no_pair_differs(cfg: RunConfig, pairs: int) -> None:
    d = cfg.data
    raise DataError(f"data.path={d.path!r}: all {pairs} pairs have the same chosen and rejected answer "
                    f"(data.chosen_column={d.chosen_column!r}, data.rejected_column={d.rejected_column!r}); DPO learns "
                    "from their difference, and there is none: point the two fields at different columns, or fix the "
                    "data")


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([_PIPELINE_VERSION, *parts], default=str).encode()).hexdigest()[:20]


def _tokenizer_key(tok: "PreTrainedTokenizerBase") -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else datasets.fingerprint.Hasher.hash(tok)
    return _key(type(tok).__name__, body, tok.eos_token_id, tok.chat_template)


def _tokenize(source: datasets.Dataset, cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> datasets.Dataset:
    d = cfg.data
    recipe = (d.template, required_columns(cfg), INSTRUCTION_TEMPLATE, CHAT_HEADERS)
    if d.template == "preference":  # only there, so other templates keep their cached data
        recipe += (_PREFERENCE_RECIPE,)
    key = _key("tokenize", source._fingerprint, _tokenizer_key(tok), recipe)
    fn = preference_tokenize_fn(cfg, tok) if d.template == "preference" else tokenize_fn(cfg, tok)
    features = datasets.Features({"ids": datasets.List(datasets.Value("int32")),
                                  "loss": datasets.List(datasets.Value("int8"))})
    return source.map(
        fn, batched=True, with_indices=True, remove_columns=source.column_names,
        features=features, num_proc=d.num_proc if d.num_proc > 1 else None, desc="tokenize",
        cache_file_name=str(data_cache_dir(cfg) / "tokenized" / f"{key}.arrow"), new_fingerprint=key)


def _pack(docs: datasets.Dataset, cfg: RunConfig) -> datasets.Dataset:
    d = cfg.data
    mode = d.packing_mode
    pairs = d.template == "preference"
    parts = [docs._fingerprint, d.seq_len, PACK_BATCH_DOCS, mode, d.overflow if mode != "concat" else None]
    key = _key("pack", *parts, *(["pairs"] if pairs else []))  # the extra part only for pairs: caches stay
    return docs.with_format("arrow").map(
        _pack_fn(d.seq_len, mode, d.overflow, pairs), batched=True, batch_size=PACK_BATCH_DOCS,
        remove_columns=docs.column_names, features=_packed_features(d.seq_len, mode, pairs),
        desc=f"pack ({mode}{', pairs' if pairs else ''})",
        cache_file_name=str(data_cache_dir(cfg) / "packed" / f"{key}.arrow"),
        new_fingerprint=key).with_format(None)


def _split_eval(packed: datasets.Dataset, cfg: RunConfig) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold out ``eval_fraction`` of the samples (at least ``global_batch_size``, so every rank gets
    a full eval micro-batch at any layout), chosen by ``train.seed``. Neighbouring samples can
    share a document, so eval loss is slightly optimistic; hold out files for a strict split."""
    n, fraction = len(packed), cfg.data.eval_fraction
    if fraction == 0 or n == 0:
        return packed, None
    n_eval = min(n, max(math.ceil(n * fraction), cfg.train.global_batch_size))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.train.seed)).numpy()
    # keep_in_memory: the index mapping is 8 bytes a sample; no cache file for ranks to race on
    return (packed.select(np.sort(order[n_eval:]), keep_in_memory=True),
            packed.select(np.sort(order[:n_eval]), keep_in_memory=True))


def _check_enough(train: datasets.Dataset, evals: datasets.Dataset | None, num_tokens: int,
                  num_docs: int, cfg: RunConfig, dropped_pairs: int = 0) -> None:
    d, g = cfg.data, cfg.train.global_batch_size
    if num_docs == 0:
        raise DataError(f"data.path={d.path!r}: every document is empty ({required_columns(cfg)} hold "
                        "only empty text); it needs at least one non-empty document")
    if len(train) >= g:
        return
    n_eval = len(evals) if evals is not None else 0
    need = 2 * g if d.eval_fraction else g  # eval keeps max(fraction, one global batch) of samples
    # Each packing batch drops less than seq_len tokens: T/L - batches >= need windows suffices.
    fit = (num_tokens - 1) // (need + math.ceil(num_docs / PACK_BATCH_DOCS))
    hint = (f"lower data.seq_len (about {fit} or less would fit) or add data" if fit >= 2 else
            "add data (even data.seq_len=2 would not be enough)")
    if d.template == "preference":
        hint = ("add pairs (data.packing=" + d.packing_mode + " keeps each pair whole in one row"
                + (", several to a row)" if d.packing_mode == "documents" else ")"))
        if dropped_pairs:
            hint = (f"{dropped_pairs} of {num_docs // 2} pairs are longer than data.seq_len={d.seq_len} "
                    f"in all (prompt twice and both answers) and were dropped: raise data.seq_len, or {hint}")
    elif d.packing_mode != "concat":  # rows of whole documents: seq_len helps only by splitting them
        hint = (f"add data (data.packing={d.packing_mode} makes at most one row per document"
                + (", fewer when several share a row)" if d.packing_mode == "documents" else ")"))
    raise DataError(
        f"data.path={d.path!r} gives {num_docs} documents, {num_tokens} tokens -> {len(train)} packed "
        f"train samples of data.seq_len={d.seq_len} (+ {n_eval} eval samples, data.eval_fraction="
        f"{d.eval_fraction}), fewer than train.global_batch_size={g}; {hint}, or lower "
        "train.global_batch_size")
