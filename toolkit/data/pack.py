"""Packing tokenized documents into samples, the cached pipeline (``prepare_data``), the eval split."""
from __future__ import annotations

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
    CHAT_HEADERS,
    INSTRUCTION_TEMPLATE,
    PACK_BATCH_DOCS,
    DataError,
    PackedData,
    data_cache_dir,
)
from toolkit.data.sources import check_rows, load_source, required_columns
from toolkit.data.templates import tokenize_fn
from toolkit.engine import IGNORE_INDEX

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


def _pack_fn(seq_len: int) -> Callable[[pa.Table], dict]:
    """Batched map function over Arrow batches of tokenized documents (flattened without copies)."""
    def pack(batch: pa.Table) -> dict:
        ids = batch.column("ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        loss = batch.column("loss").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        return pack_tokens(ids, loss, seq_len)
    return pack


def _packed_features(seq_len: int) -> datasets.Features:
    return datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32"), length=seq_len),
        "labels": datasets.List(datasets.Value("int32"), length=seq_len),
        "num_loss_tokens": datasets.Value("int32")})


# --- prepare -------------------------------------------------------------------------------------

def prepare_data(cfg: RunConfig, tokenizer: "PreTrainedTokenizerBase") -> PackedData:
    """Load ``data.path``, check it, tokenize, pack and split off eval; cached in ``data.cache_dir``.

    Raises DataError before any training for a missing source or column, an empty source, non-text
    values, or fewer packed train samples than ``train.global_batch_size``."""
    source = load_source(cfg)
    check_rows(source, cfg)
    source = source.select_columns(list(required_columns(cfg).values()))
    docs = _tokenize(source, cfg, tokenizer)
    packed = _pack(docs, cfg)
    num_tokens = int(pc.sum(pc.list_value_length(docs.data.column("ids"))).as_py() or 0)
    train, evals = _split_eval(packed, cfg)
    _check_enough(train, evals, num_tokens, len(docs), cfg)
    return PackedData(train=train, eval=evals, num_tokens=num_tokens, num_documents=len(docs))


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([_PIPELINE_VERSION, *parts], default=str).encode()).hexdigest()[:20]


def _tokenizer_key(tok: "PreTrainedTokenizerBase") -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else datasets.fingerprint.Hasher.hash(tok)
    return _key(type(tok).__name__, body, tok.eos_token_id, tok.chat_template)


def _tokenize(source: datasets.Dataset, cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> datasets.Dataset:
    d = cfg.data
    recipe = (d.template, required_columns(cfg), INSTRUCTION_TEMPLATE, CHAT_HEADERS)
    key = _key("tokenize", source._fingerprint, _tokenizer_key(tok), recipe)
    features = datasets.Features({"ids": datasets.List(datasets.Value("int32")),
                                  "loss": datasets.List(datasets.Value("int8"))})
    return source.map(
        tokenize_fn(cfg, tok), batched=True, with_indices=True, remove_columns=source.column_names,
        features=features, num_proc=d.num_proc if d.num_proc > 1 else None, desc="tokenize",
        cache_file_name=str(data_cache_dir(cfg) / "tokenized" / f"{key}.arrow"), new_fingerprint=key)


def _pack(docs: datasets.Dataset, cfg: RunConfig) -> datasets.Dataset:
    key = _key("pack", docs._fingerprint, cfg.data.seq_len, PACK_BATCH_DOCS)
    return docs.with_format("arrow").map(
        _pack_fn(cfg.data.seq_len), batched=True, batch_size=PACK_BATCH_DOCS,
        remove_columns=docs.column_names, features=_packed_features(cfg.data.seq_len), desc="pack",
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
                  num_docs: int, cfg: RunConfig) -> None:
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
    raise DataError(
        f"data.path={d.path!r} gives {num_docs} documents, {num_tokens} tokens -> {len(train)} packed "
        f"train samples of data.seq_len={d.seq_len} (+ {n_eval} eval samples, data.eval_fraction="
        f"{d.eval_fraction}), fewer than train.global_batch_size={g}; {hint}, or lower "
        "train.global_batch_size")
