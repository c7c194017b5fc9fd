"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``): our numpy reader and writer.

The format, as megatron-core's ``IndexedDatasetBuilder`` and Megatron-LM's ``preprocess_data.py`` write
it (little endian): ``PREFIX.idx`` = ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version 1, ``<B`` dtype code, ``<Q``
sequence count S, ``<Q`` document-index count D + 1, ``int32[S]`` sequence lengths, ``int64[S]`` byte
offsets into ``.bin``, ``int64[D + 1]`` document indices (document d = sequences ``doc_idx[d]:doc_idx[d+1]``;
several only in ``--split-sentences`` prefixes), then ``int8[S]`` modes for multimodal prefixes only.
``PREFIX.bin``: the tokens back to back in that dtype. Our writer is byte-identical to megatron-core's
builder (``tests/unit/test_data_indexed.py``), which stays a test reference: megatron-core is an optional
install and only ``adapters/`` may import it.

A prefix written by ``toolkit prepare`` has a ``PREFIX.json`` sidecar (its tokenizer, EOS rule, counts;
written last: its presence says the prefix is complete) and, when some tokens carry no loss (templates
instruction and chat), a companion prefix ``PREFIX_loss`` (uint8, one 0/1 per token, same documents).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator

import numpy as np

from toolkit.data.base import DataError

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8
TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_CODES = {np.dtype(v): k for k, v in TOKEN_DTYPES.items()}
LOSS_SUFFIX = "_loss"
SIDECAR_FORMAT = "toolkit-indexed"


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule (``DType.optimal_dtype``, used by ``preprocess_data.py``): uint16 below 65500 ids."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def prefix_of(part: str) -> str | None:
    """The prefix a ``data.path`` part names (``P`` with ``P.bin`` and ``P.idx``, or ``P.bin``/``P.idx``
    itself), or None when it names no indexed dataset. Half a prefix (one file of the two) is a DataError."""
    path = str(Path(part).expanduser())
    base = path[:-4] if path.endswith((".bin", ".idx")) else path
    has_bin, has_idx = os.path.isfile(base + ".bin"), os.path.isfile(base + ".idx")
    if has_bin and has_idx:
        return base
    if has_bin != has_idx and (path != base or not os.path.exists(path)):
        there, missing = (".bin", ".idx") if has_bin else (".idx", ".bin")
        raise DataError(f"data.path part {part!r}: {base}{there} is there but {base}{missing} is missing; an "
                        "indexed dataset is the pair PREFIX.bin + PREFIX.idx (write both with toolkit prepare "
                        "or megatron's preprocess_data.py)")
    return None


class IndexedPrefix:
    """A memory-mapped prefix: ``dtype``, ``sequence_lengths`` [S], ``sequence_pointers`` [S] (bytes),
    ``document_indices`` [D + 1], ``tokens`` [N] (a read-only memmap of ``.bin``); the sidecar as ``meta``
    (None for a foreign prefix)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx = Path(prefix + ".idx")
        raw = np.memmap(idx, mode="r", dtype=np.uint8) if idx.stat().st_size else np.zeros(0, np.uint8)
        if len(raw) < _HEADER or bytes(raw[:len(MAGIC)]) != MAGIC:
            raise DataError(f"{idx} is not a Megatron index (no {MAGIC!r} header); was it written by "
                            "IndexedDatasetBuilder / preprocess_data.py / toolkit prepare?")
        version, code = struct.unpack("<Q", bytes(raw[9:17]))[0], int(raw[17])
        if version != 1 or code not in TOKEN_DTYPES:
            raise DataError(f"{idx}: index version {version}, dtype code {code}; this reader knows version 1 "
                            f"with dtype codes {sorted(TOKEN_DTYPES)}")
        count, doc_count = struct.unpack("<QQ", bytes(raw[18:34]))
        need = _HEADER + 12 * count + 8 * doc_count
        if len(raw) < need:
            raise DataError(f"{idx} is cut short: {len(raw)} bytes, its header needs {need}; write it again")
        self.dtype = np.dtype(TOKEN_DTYPES[code])
        self.sequence_lengths = np.frombuffer(raw, np.int32, count, _HEADER)
        self.sequence_pointers = np.frombuffer(raw, np.int64, count, _HEADER + 4 * count)
        self.document_indices = np.frombuffer(raw, np.int64, doc_count, _HEADER + 12 * count)
        size = os.path.getsize(prefix + ".bin")
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if count else 0
        if size < end:
            raise DataError(f"{prefix}.bin has {size} bytes, its index points up to byte {end}: the .bin is "
                            "truncated or belongs to another index")
        self.tokens = np.memmap(prefix + ".bin", mode="r", dtype=self.dtype) if size else np.zeros(0, self.dtype)
        self.meta = read_sidecar(prefix)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_spans(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """(token start, length) of documents ``first:last``: a document's sequences are contiguous in
        ``.bin`` as both writers lay them out, so its tokens are one span."""
        if not len(self.sequence_lengths):
            return np.zeros(max(last - first, 0), np.int64), np.zeros(max(last - first, 0), np.int64)
        seq_first = self.document_indices[first:last]
        seq_last = self.document_indices[first + 1:last + 1]
        nonempty = seq_last > seq_first
        first_seq, last_seq = np.where(nonempty, seq_first, 0), np.where(nonempty, seq_last - 1, 0)
        size = self.dtype.itemsize
        starts = self.sequence_pointers[first_seq] // size
        ends = self.sequence_pointers[last_seq] // size + self.sequence_lengths[last_seq]
        return np.where(nonempty, starts, 0).astype(np.int64), np.where(nonempty, ends - starts, 0).astype(np.int64)

    def describe(self) -> dict:
        """What ``toolkit inspect PREFIX`` prints."""
        return {"format": "megatron indexed dataset", "prefix": self.prefix, "documents": self.num_documents,
                "sequences": len(self.sequence_lengths), "tokens": self.num_tokens, "dtype": self.dtype.name,
                "bin_bytes": os.path.getsize(self.prefix + ".bin"),
                "loss_mask": os.path.isfile(self.prefix + LOSS_SUFFIX + ".idx"),
                "tokenizer": (self.meta or {}).get("tokenizer", {}).get("name", "unknown: no PREFIX.json"),
                "eos_appended": (self.meta or {}).get("eos_appended")}


def read_sidecar(prefix: str) -> dict | None:
    path = Path(prefix + ".json")
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise DataError(f"{path} is not JSON ({exc}); delete it to read {prefix} as a foreign prefix") from exc
    return meta if isinstance(meta, dict) and meta.get("format") == SIDECAR_FORMAT else None


class PrefixWriter:
    """Appends documents to ``PREFIX.bin`` and their lengths to a side file, then ``finalize`` writes
    ``PREFIX.idx`` from that file in blocks (memory bounded by the block, not the corpus). One sequence
    per document, as ``IndexedDatasetBuilder.add_item`` + ``end_document`` write them."""

    def __init__(self, bin_path: str, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.bin_path = bin_path
        self._bin = open(bin_path, "wb")
        self._lengths = open(bin_path + ".lengths", "wb")
        self.documents = 0
        self.tokens = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Documents of ``lengths`` [D] tokens, back to back in ``flat``."""
        self._bin.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())
        self._lengths.write(np.asarray(lengths, dtype=np.int32).tobytes())
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths, dtype=np.int64))

    def finalize(self, idx_path: str, block: int = 1 << 20) -> None:
        self._bin.close()
        self._lengths.close()
        lengths_path = self.bin_path + ".lengths"
        n = os.path.getsize(lengths_path) // 4
        with open(idx_path, "wb") as out, open(lengths_path, "rb") as lengths_file:
            out.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _CODES[self.dtype])
                      + struct.pack("<QQ", n, n + 1))
            for lengths in _blocks(lengths_file, np.int32, block):
                out.write(lengths.tobytes())
            lengths_file.seek(0)
            offset = 0
            for lengths in _blocks(lengths_file, np.int32, block):
                ends = offset + np.cumsum(lengths, dtype=np.int64)
                out.write(((ends - lengths) * self.dtype.itemsize).tobytes())
                offset = int(ends[-1])
            for start in range(0, n + 1, block):
                out.write(np.arange(start, min(start + block, n + 1), dtype=np.int64).tobytes())
        os.unlink(lengths_path)

    def abort(self) -> None:
        self._bin.close()
        self._lengths.close()


def _blocks(f, dtype, block: int) -> Iterator[np.ndarray]:
    while chunk := f.read(block * np.dtype(dtype).itemsize):
        yield np.frombuffer(chunk, dtype)


def write_prefix(prefix: str, documents: list, dtype) -> None:
    """A whole prefix from a list of documents (tests and small tools)."""
    writer = PrefixWriter(prefix + ".bin", dtype)
    lengths = np.array([len(d) for d in documents], np.int64)
    writer.add(np.concatenate([np.asarray(d, np.int64) for d in documents]) if documents else np.zeros(0),
               lengths)
    writer.finalize(prefix + ".idx")
