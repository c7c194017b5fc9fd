"""``toolkit prepare``: tokenize a source into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).

The source (any ``data.path`` a run takes, except a prefix) is read as a stream, ``PACK_BATCH_DOCS`` rows
at a time, tokenized by the run's own ``tokenize_fn`` (the model's tokenizer, ``data.template``, EOS at the
end of each document, no BOS, empty documents dropped) in ``data.num_proc`` worker processes, and appended
to the output as it comes: memory holds a few chunks in flight, whatever the corpus's size. Document
lengths go to a side file and become ``PREFIX.idx`` at the end (written in blocks). Templates whose
prompts carry no loss (instruction, chat) also write the companion prefix ``PREFIX_loss`` (uint8 0/1 per
token). ``PREFIX.json`` (tokenizer, template, counts) is written last: it says the prefix is complete.

Killed part-way, ``toolkit prepare`` starts afresh on the next call (it writes ``PREFIX.partial.*`` files and
renames them into place at the end): a restart costs the time spent, never a corrupt prefix.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from toolkit.config import RunConfig
from toolkit.data.base import PACK_BATCH_DOCS, DataError
from toolkit.data.indexed import LOSS_SUFFIX, SIDECAR_FORMAT, PrefixWriter, optimal_dtype, prefix_of

_worker_tokenize: Callable | None = None


def prepare_prefix(cfg: RunConfig, out: str, overwrite: bool = False, progress: bool | None = None) -> dict:
    """Write ``out``.bin/.idx (and ``out``_loss.* for masked templates) from ``data.path``; returns the sidecar."""
    from toolkit.data.pack import _tokenizer_key  # here, not at the top: workers load no torch
    from toolkit.data.tokenizer import load_tokenizer
    d = cfg.data
    from toolkit.data.vision import is_vision_model
    if is_vision_model(cfg.model.name_or_path):
        raise DataError("toolkit prepare writes token prefixes, and a vision-language model's rows carry images "
                        "(docs/vlm.md): train from the data file itself")
    if d.template == "preference":
        raise DataError("toolkit prepare writes documents; data.template=preference needs pairs (DPO scores each "
                        "pair before training): train DPO from the source file")
    if d.weights is not None:
        raise DataError("toolkit prepare writes one source; prepare each part of a blend alone (one --out each) "
                        "and blend the prefixes with data.weights")
    _check_output(out, overwrite)
    from toolkit.data.load import indexed_prefixes
    from toolkit.data.sources import stream_rows
    if indexed_prefixes(cfg):
        raise DataError(f"data.path={d.path!r} is already a Megatron indexed dataset: train from it as it is")
    rows = stream_rows(cfg)  # before the workers: a bad path fails here, at once
    tok = load_tokenizer(cfg)
    dtype = optimal_dtype(len(tok))
    masked = d.template != "none"
    partial = out + ".partial"
    Path(out).expanduser().parent.mkdir(parents=True, exist_ok=True)
    tokens = PrefixWriter(partial + ".bin", dtype)
    loss = PrefixWriter(partial + LOSS_SUFFIX + ".bin", np.uint8) if masked else None
    max_id, tic = -1, time.perf_counter()
    bar = _progress_bar(progress)
    for ids, mask, lengths in _tokenized(rows, cfg):
        tokens.add(ids, lengths)
        if loss is not None:
            loss.add(mask, lengths)
        max_id = max(max_id, int(ids.max()) if len(ids) else -1)
        bar.update(len(lengths))
        bar.set_postfix_str(f"{tokens.tokens:,} tokens, {tokens.tokens / (time.perf_counter() - tic):,.0f}/s")
    bar.close()
    if tokens.documents == 0:
        tokens.abort()
        raise DataError(f"data.path={d.path!r}: every document is empty; nothing to prepare")
    _finalize(tokens, partial, out)
    if loss is not None:
        _finalize(loss, partial + LOSS_SUFFIX, out + LOSS_SUFFIX)
    meta = {"format": SIDECAR_FORMAT, "version": 1, "documents": tokens.documents, "tokens": tokens.tokens,
            "dtype": np.dtype(dtype).name, "max_token_id": max_id, "eos_appended": True, "bos": None,
            "tokenizer": {"name": cfg.model.tokenizer or cfg.model.name_or_path, "key": _tokenizer_key(tok),
                          "eos_token_id": tok.eos_token_id, "vocab": len(tok)},
            "template": d.template, "loss_mask": masked, "source": {"path": d.path, "format": d.format},
            "seconds": round(time.perf_counter() - tic, 3)}
    from toolkit.storage import write_json_durable
    write_json_durable(Path(out + ".json"), meta)
    return meta


def _check_output(out: str, overwrite: bool) -> None:
    there = [out + ext for ext in (".bin", ".idx", ".json") if os.path.exists(out + ext)]
    if there and not overwrite:
        state = "a complete prefix" if os.path.exists(out + ".json") else "an incomplete prefix (no PREFIX.json)"
        raise DataError(f"--out {out}: {there[0]} exists ({state}); choose another --out, or pass --overwrite "
                        "to replace it")


def _finalize(writer: PrefixWriter, partial: str, out: str) -> None:
    writer.finalize(partial + ".idx")
    os.replace(partial + ".bin", out + ".bin")
    os.replace(partial + ".idx", out + ".idx")


def _progress_bar(enabled: bool | None):
    from tqdm.auto import tqdm
    return tqdm(desc="prepare", unit=" docs", file=sys.stderr, disable=None if enabled is None else not enabled)


def _tokenized(rows, cfg: RunConfig) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids int64 [T], loss int8 [T], lengths [D]) per chunk of ``PACK_BATCH_DOCS`` rows, in order; chunks are
    tokenized by ``data.num_proc`` processes with at most two chunks per process in flight."""
    chunks = _chunks(rows)
    if cfg.data.num_proc == 1:
        _init_worker(cfg)
        yield from map(_tokenize_chunk, chunks)
        return
    ctx = multiprocessing.get_context("spawn")  # no forked copy of this process's tokenizer threads
    with ctx.Pool(cfg.data.num_proc, initializer=_init_worker, initargs=(cfg,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_tokenize_chunk, (chunk,)))
            if len(pending) >= 2 * cfg.data.num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _chunks(rows) -> Iterator[tuple[int, dict]]:
    start = 0
    for batch in rows.iter(batch_size=PACK_BATCH_DOCS):
        n = len(next(iter(batch.values())))
        yield start, batch
        start += n


def _init_worker(cfg: RunConfig) -> None:
    global _worker_tokenize
    from toolkit.data.templates import tokenize_fn
    from toolkit.data.tokenizer import load_tokenizer
    _worker_tokenize = tokenize_fn(cfg, load_tokenizer(cfg))


def _tokenize_chunk(chunk: tuple[int, dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    start, batch = chunk
    n = len(next(iter(batch.values())))
    out = _worker_tokenize(batch, list(range(start, start + n)))
    lengths = np.array([len(ids) for ids in out["ids"]], np.int64)
    if not len(lengths):
        return np.zeros(0, np.int64), np.zeros(0, np.int8), lengths
    flat = np.concatenate([np.asarray(ids, np.int64) for ids in out["ids"]])
    mask = np.concatenate([np.asarray(loss, np.int8) for loss in out["loss"]])
    return flat, mask, lengths


def cmd_prepare(args) -> int:
    """``toolkit prepare [CONFIG] [--set ...] --out PREFIX [--overwrite]``."""
    from toolkit.config import load_config
    meta = prepare_prefix(load_config(args.config, args.overrides), args.out, overwrite=args.overwrite)
    print(f"toolkit: wrote {args.out}.bin/.idx: {meta['documents']:,} documents, {meta['tokens']:,} tokens "
          f"({meta['dtype']}, {meta['tokens'] / max(meta['seconds'], 1e-9):,.0f} tokens/s); train with "
          f"data.path={args.out}")
    return 0


def describe_prefix(path: str) -> dict | None:
    """``toolkit inspect PREFIX``: what the prefix holds, or None when ``path`` names no prefix."""
    from toolkit.data.indexed import IndexedPrefix
    prefix = prefix_of(path)
    if prefix is None:
        return None
    data = IndexedPrefix(prefix)
    info = data.describe()
    if data.num_documents:
        start, length = data.document_spans(0, 1)
        info["first_document_ids"] = np.asarray(data.tokens[start[0]:start[0] + min(length[0], 32)]).tolist()
    return info
