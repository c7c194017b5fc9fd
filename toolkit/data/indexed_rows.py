"""Packed rows from a Megatron indexed dataset (``data.path`` naming PREFIX.bin + PREFIX.idx).

Each document of the prefix goes through the very packing functions the jsonl path uses
(``pack_tokens`` / ``pack_documents``, per batch of ``PACK_BATCH_DOCS`` non-empty documents), so a prefix
written by ``toolkit prepare`` and the source it was prepared from give the same rows, in the same order,
with the same losses. The prefix is read through a memmap, one pack batch at a time; the rows are cached
(Arrow, like the jsonl path's packed rows) under ``data_cache_dir/indexed/``, keyed by the prefix's
files (size and mtime), the tokenizer's EOS and the packing settings.

Checks (DataError before any rank starts): a sidecar naming another tokenizer; a dtype that cannot hold
the tokenizer's ids; a token id beyond the tokenizer's vocabulary (every token is seen while packing);
a foreign prefix (no sidecar) whose documents end with EOS only sometimes. A foreign prefix whose
documents never end with EOS (``preprocess_data.py`` without ``--append-eod``) gets it appended as the
toolkit's own documents have it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import datasets
import numpy as np

from toolkit.config import RunConfig
from toolkit.data.base import PACK_BATCH_DOCS, DataError, data_cache_dir
from toolkit.data.indexed import LOSS_SUFFIX, IndexedPrefix
from toolkit.data.pack import _key, _pack_batch, _packed_features, _tokenizer_key

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DOC_BLOCK = 1 << 20  # documents whose spans are read at once (16 B each)
_EOS_PROBE = 1000  # foreign prefixes: documents whose last token tells the EOS rule


def open_prefix(prefix: str, tok: "PreTrainedTokenizerBase") -> tuple[IndexedPrefix, IndexedPrefix | None, bool]:
    """(tokens, loss companion or None, whether EOS is appended on read), after the tokenizer checks."""
    data = IndexedPrefix(prefix)
    vocab = len(tok)
    if data.dtype.kind not in "iu":
        raise DataError(f"{prefix}.idx: token dtype {data.dtype.name} is not an integer type; token ids are")
    if np.iinfo(data.dtype).max < vocab - 1:
        raise DataError(f"{prefix}: tokens are stored as {data.dtype.name} (ids up to {np.iinfo(data.dtype).max}), "
                        f"but this run's tokenizer has {vocab} ids: the prefix was written for another "
                        "tokenizer; prepare it again with this one (toolkit prepare) or set model.tokenizer")
    if data.meta is not None:
        recorded = data.meta.get("tokenizer", {})
        if recorded.get("key") != _tokenizer_key(tok):
            raise DataError(f"{prefix} was prepared with tokenizer {recorded.get('name')!r} (key "
                            f"{recorded.get('key')}); this run's tokenizer differs (key {_tokenizer_key(tok)}): "
                            "prepare the data again with this run's config (toolkit prepare), or set "
                            "model.tokenizer to the one it was prepared with")
    loss = _loss_companion(prefix, data)
    append_eos = False if data.meta is not None else _foreign_eos_rule(data, tok.eos_token_id)
    return data, loss, append_eos


def _loss_companion(prefix: str, data: IndexedPrefix) -> IndexedPrefix | None:
    if not Path(prefix + LOSS_SUFFIX + ".idx").is_file():
        return None
    loss = IndexedPrefix(prefix + LOSS_SUFFIX)
    if loss.num_documents != data.num_documents or loss.num_tokens != data.num_tokens:
        raise DataError(f"{prefix}{LOSS_SUFFIX} (the loss mask) has {loss.num_documents} documents, "
                        f"{loss.num_tokens} tokens; {prefix} has {data.num_documents}, {data.num_tokens}: they "
                        "were written apart; prepare the data again")
    return loss


def _foreign_eos_rule(data: IndexedPrefix, eos: int) -> bool:
    """Whether to append EOS to each document of a prefix without sidecar (see the module's doc)."""
    starts, lengths = data.document_spans(0, min(data.num_documents, 50 * _EOS_PROBE))
    ends = (starts + lengths - 1)[lengths > 0][:_EOS_PROBE]
    if not len(ends):
        return False
    last = np.asarray(data.tokens[ends], dtype=np.int64)
    if (last == eos).all():
        return False
    if (last != eos).all():
        print(f"toolkit: data.path={data.prefix}: documents do not end with EOS (id {eos}); the toolkit "
              "appends it as it packs (the toolkit's documents end with EOS)", flush=True)
        return True
    raise DataError(f"{data.prefix}: of the first {len(last)} documents, {int((last == eos).sum())} end with EOS "
                    f"(id {eos}) and {int((last != eos).sum())} do not: was it written with this tokenizer? "
                    "Prepare it again (toolkit prepare, or preprocess_data.py --append-eod)")


def pack_batches(data: IndexedPrefix, loss: IndexedPrefix | None, eos: int | None,
                 vocab: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids [T] int32, loss [T] int8, lengths [D]) per batch of ``PACK_BATCH_DOCS`` non-empty documents
    (empty ones are skipped, as the jsonl path drops them), EOS appended when ``eos`` is given."""
    pending: list[np.ndarray] = []
    for first in range(0, data.num_documents, _DOC_BLOCK):
        last = min(first + _DOC_BLOCK, data.num_documents)
        starts, lengths = data.document_spans(first, last)
        keep = np.flatnonzero(lengths > 0)
        pending.append(np.stack([starts[keep], lengths[keep]], axis=1))
        spans = np.concatenate(pending)
        full = len(spans) // PACK_BATCH_DOCS * PACK_BATCH_DOCS
        for at in range(0, full, PACK_BATCH_DOCS):
            yield _read(data, loss, spans[at:at + PACK_BATCH_DOCS], eos, vocab)
        pending = [spans[full:]]
    if len(pending[0]):
        yield _read(data, loss, pending[0], eos, vocab)


def _read(data: IndexedPrefix, loss: IndexedPrefix | None, spans: np.ndarray, eos: int | None,
          vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pack batch copied out of the memmaps (never a view: the map may close before it is used)."""
    ids = np.concatenate([data.tokens[s:s + n] for s, n in spans]).astype(np.int32)
    mask = (np.concatenate([loss.tokens[s:s + n] for s, n in spans]).astype(np.int8) if loss is not None
            else np.ones(len(ids), np.int8))
    lengths = spans[:, 1].astype(np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
        raise DataError(f"{data.prefix}: token id {int(ids[bad])} is outside this run's tokenizer "
                        f"(ids 0..{vocab - 1}): the prefix was written with another tokenizer; prepare it "
                        "again with this run's (toolkit prepare) or set model.tokenizer")
    if eos is not None:  # the foreign prefix's documents get the EOS the toolkit's documents end with
        ends = np.cumsum(lengths)
        ids, mask = np.insert(ids, ends, eos), np.insert(mask, ends, 1)
        lengths = lengths + 1
    return ids, mask, lengths


def packed_prefix(prefix: str, cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> tuple[datasets.Dataset, dict]:
    """The packed rows of ``prefix`` (cached) and its counts: ``tokens``, ``documents``, ``overflow``."""
    d = cfg.data
    data, loss, append_eos = open_prefix(prefix, tok)
    mode = d.packing_mode
    files = [prefix + ext for ext in (".bin", ".idx")] + \
        ([prefix + LOSS_SUFFIX + ext for ext in (".bin", ".idx")] if loss is not None else [])
    stamp = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    key = _key("indexed", stamp, tok.eos_token_id, append_eos, len(tok), d.seq_len, PACK_BATCH_DOCS, mode,
               d.overflow if mode != "concat" else None)
    path = data_cache_dir(cfg) / "indexed" / f"{key}.arrow"
    counts_path = path.with_suffix(".counts.npy")
    if not (path.is_file() and counts_path.is_file()):
        _write_rows(path, counts_path, data, loss, append_eos, tok, cfg)
    tokens, documents, overflow = (int(x) for x in np.load(counts_path))
    return datasets.Dataset.from_file(str(path)), {"tokens": tokens, "documents": documents, "overflow": overflow}


def _write_rows(path: Path, counts_path: Path, data: IndexedPrefix, loss: IndexedPrefix | None, append_eos: bool,
                tok: "PreTrainedTokenizerBase", cfg: RunConfig) -> None:
    """Pack batch after batch into an Arrow file (written under a temporary name, then renamed)."""
    from datasets.arrow_writer import ArrowWriter

    d = cfg.data
    mode = d.packing_mode
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tokens = documents = overflow = 0
    with ArrowWriter(features=_packed_features(d.seq_len, mode), path=str(tmp)) as writer:
        for ids, mask, lengths in pack_batches(data, loss, tok.eos_token_id if append_eos else None, len(tok)):
            writer.write_batch(_pack_batch(ids, mask, lengths, d.seq_len, mode, d.overflow))
            tokens += len(ids)
            documents += len(lengths)
            overflow += 0 if mode == "concat" else int((lengths > d.seq_len + 1).sum())
        writer.finalize()
    tmp_counts = counts_path.with_name(f"{counts_path.name}.{os.getpid()}.tmp.npy")
    np.save(tmp_counts, np.array([tokens, documents, overflow], np.int64))
    os.replace(tmp, path)
    os.replace(tmp_counts, counts_path)
