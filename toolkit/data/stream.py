"""Streaming sources (``data.streaming: true``): read, tokenize and pack as the run trains, never whole.

Every DP rank runs the same deterministic pipeline (so no collective and no DP-dependent position):
chunk c of epoch e = the next ``STREAM_CHUNK_DOCS`` rows of the source (``datasets`` streaming), tokenized
by the run's ``tokenize_fn`` and packed per ``PACK_BATCH_DOCS`` rows by the jsonl path's ``_pack_batch``,
then permuted by a generator seeded from (seed, e, c). Global batch s is the next ``G`` rows of that
stream (a batch may straddle chunks and epochs; an epoch ends where the source does and the next one
reopens it). Memory: one chunk of rows, whatever the source's size.

Position: before batch s, ``{"epoch", "chunk", "offset", "source_state"}`` with ``source_state`` the
source's ``state_dict()`` at the chunk's first row (``datasets`` resumes it exactly at an example, F4 of
the design note; its ``shuffle`` would not, so none is used). Checkpoints store the position of their
step in trainer.json (``data_stream``); a resume reopens the source there, rebuilds the chunk and skips
``offset`` rows: the next token is the one the uninterrupted run trains on, at any DP size.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
from typing import TYPE_CHECKING

import datasets
import numpy as np
import torch

from toolkit.config import RunConfig
from toolkit.data.base import PACK_BATCH_DOCS, DataError, PackedData
from toolkit.data.pack import _pack_batch, _packed_features
from toolkit.data.sources import stream_rows
from toolkit.data.templates import tokenize_fn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STREAM_CHUNK_DOCS = 8 * PACK_BATCH_DOCS
"""Source rows per shuffled chunk: the window the order is shuffled in, and what memory holds."""
_KEEP_POSITIONS = 8


class StreamBatches:
    """Global batches of a streamed source, in order (see the module's doc)."""

    def __init__(self, cfg: RunConfig, tok: "PreTrainedTokenizerBase", chunk_docs: int = STREAM_CHUNK_DOCS):
        self.cfg, self.chunk_docs = cfg, chunk_docs
        self._tokenize = tokenize_fn(cfg, tok)
        self._features = _packed_features(cfg.data.seq_len, cfg.data.packing_mode)
        self._positions: dict[int, dict] = {}
        self._next_step = 0
        self.seek({"epoch": 0, "chunk": 0, "offset": 0, "source_state": None}, 0)

    # --- position -------------------------------------------------------------------------------

    def seek(self, position: dict, step: int) -> None:
        """Continue at ``position`` (what ``position(step)`` returned), so the next batch is ``step``'s."""
        self.epoch, self.chunk = position["epoch"], position["chunk"]
        self._source = stream_rows(self.cfg)
        if position["source_state"] is not None:
            self._source.load_state_dict(copy.deepcopy(position["source_state"]))
        self._rows_iter = iter(self._source)
        self._load_chunk()
        if self._rows is None:
            raise DataError(f"data.path={self.cfg.data.path!r}: the stream has no rows at the saved position "
                            f"(epoch {self.epoch}, chunk {self.chunk}): was the source changed since the checkpoint?")
        self.offset = position["offset"]
        self._next_step = step
        self._positions = {step: dict(position)}

    def position(self, step: int) -> dict:
        """Where batch ``step`` starts (for the checkpoint of ``step``); known once batch ``step - 1`` was made."""
        if step not in self._positions:
            raise RuntimeError(f"stream position of step {step} unknown (known: {sorted(self._positions)})")
        return self._positions[step]

    # --- batches --------------------------------------------------------------------------------

    def global_batch(self, step: int, size: int) -> datasets.Dataset:
        """The ``size`` rows of batch ``step`` (steps come in order, as the trainer asks for them)."""
        if step != self._next_step:
            if step not in self._positions:
                raise RuntimeError(f"streamed batches come in order: asked for step {step}, next is {self._next_step}")
            self.seek(self._positions[step], step)
        parts = []
        need = size
        while need:
            take = min(need, len(self._rows["input_ids"]) - self.offset)
            parts.append({k: v[self.offset:self.offset + take] for k, v in self._rows.items()})
            self.offset += take
            need -= take
            if self.offset == len(self._rows["input_ids"]):
                self._advance()
        self._next_step = step + 1
        self._positions[step + 1] = self._here()
        for old in [s for s in self._positions if s < step + 1 - _KEEP_POSITIONS]:
            del self._positions[old]
        rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return datasets.Dataset.from_dict({k: list(v) for k, v in rows.items()}, features=self._features)

    def first_chunk(self) -> datasets.Dataset:
        return datasets.Dataset.from_dict({k: list(v) for k, v in self._rows.items()}, features=self._features)

    def _here(self) -> dict:
        return {"epoch": self.epoch, "chunk": self.chunk, "offset": self.offset,
                "source_state": copy.deepcopy(self._chunk_state)}

    def _advance(self) -> None:
        """The next chunk with rows, reopening the source at an epoch's end."""
        for _ in range(2):
            while True:
                self.chunk += 1
                self._load_chunk()
                if self._rows is None:
                    break
                if len(self._rows["input_ids"]):
                    self.offset = 0
                    return
            self.epoch, self.chunk = self.epoch + 1, -1
            self._source = stream_rows(self.cfg)
            self._rows_iter = iter(self._source)
        raise DataError(f"data.path={self.cfg.data.path!r}: a whole pass over the stream gives no row of "
                        f"data.seq_len={self.cfg.data.seq_len}; add data or lower data.seq_len")

    def _load_chunk(self) -> None:
        """Read, tokenize, pack and permute chunk ``self.chunk``; ``_rows`` None when the source is exhausted."""
        self._chunk_state = copy.deepcopy(self._source.state_dict())
        examples = list(itertools.islice(self._rows_iter, self.chunk_docs))
        if not examples:
            self._rows = None
            return
        d = self.cfg.data
        packed = []
        for at in range(0, len(examples), PACK_BATCH_DOCS):
            batch = examples[at:at + PACK_BATCH_DOCS]
            out = self._tokenize({k: [e[k] for e in batch] for k in batch[0]}, list(range(at, at + len(batch))))
            lengths = np.array([len(x) for x in out["ids"]], np.int64)
            if not len(lengths):
                continue
            ids = np.concatenate([np.asarray(x, np.int32) for x in out["ids"]])
            loss = np.concatenate([np.asarray(x, np.int8) for x in out["loss"]])
            packed.append(_pack_batch(ids, loss, lengths, d.seq_len, d.packing_mode, d.overflow))
        keys = list(self._features)
        rows = {k: np.concatenate([p[k] for p in packed]) if packed else np.zeros((0,), np.int32) for k in keys}
        mixed = hashlib.sha256(f"{self.cfg.train.seed}/stream/{self.epoch}/{self.chunk}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") & (2**63 - 1))
        order = torch.randperm(len(rows["input_ids"]), generator=gen).numpy()
        self._rows = {k: v[order] for k, v in rows.items()}


def prepare_stream(cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> PackedData:
    """A streamed run's data: the pipeline, checked on its first chunk (``train`` holds that chunk's rows)."""
    d = cfg.data
    if d.eval_fraction > 0:
        raise DataError("data.streaming reads the source as it trains and cannot hold out a random "
                        f"data.eval_fraction={d.eval_fraction} without reading it all; set data.eval_fraction=0 "
                        "(or prepare the data with toolkit prepare and train from the prefix, which holds it out)")
    if d.template == "preference":
        raise DataError("data.streaming with data.template=preference: DPO scores every pair before training; "
                        "train it from the source without streaming")
    stream = StreamBatches(cfg, tok)
    first = stream.first_chunk()
    if not len(first):
        stream._advance()  # raises when no chunk of the whole source gives a row
        first = stream.first_chunk()
    counts = first.with_format("numpy")
    return PackedData(train=first, eval=None, packing=d.packing_mode, stream=stream,
                      num_tokens=int(counts["num_tokens"].sum()) if "num_tokens" in first.column_names else 0,
                      num_documents=int(counts["num_documents"].sum()) if "num_documents" in first.column_names else 0)
