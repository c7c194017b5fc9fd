"""Weighted blends of sources (``data.weights``), with Megatron's blending rule.

Each comma-separated part of ``data.path`` is a source, prepared alone (its own tokenize/pack cache or
Megatron prefix, its own eval split); their train rows are concatenated (source d at rows
``offsets[d]:offsets[d] + sizes[d]``). Global position p = ``step * G + j`` goes to source
``blend(p)`` by megatron-core's ``build_blending_indices`` rule (helpers.cpp): at position i pick
``argmax_d(w_d * max(i, 1) - c_d)`` (the first on ties), then ``c_d += 1``; the realized count of
every source stays within one sample of ``w_d * p`` at every prefix. The k-th sample of source d is row
``order_d(k)``: endless per-epoch permutations of its rows seeded by (seed, d, epoch), as a single
source's order is. The rule runs in pure Python over blocks of positions, each block started from the
count vector at its start, so a step's samples are a function of (weights, sizes, seed, step) alone:
exact resume at any DP size, like the single-source order.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import datasets
import numpy as np

from toolkit.config import RunConfig
from toolkit.data.base import DataError, PackedData
from toolkit.data.batches import _epoch_permutation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BLOCK = 1 << 16
"""Positions per block of the blending index; a block costs ~0.1 s of pure Python and 640 KB."""


def blend_block(weights: list[float], start: int, counts: list[int], size: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Megatron's blending rule for positions ``[start, start + size)``, from the per-source ``counts`` at
    ``start``: (source [size] int16, sample index within its source [size] int64, counts after)."""
    w = [float(x) for x in weights]
    c = list(counts)
    k = len(w)
    src = np.empty(size, np.int16)
    idx = np.empty(size, np.int64)
    for i in range(start, start + size):
        p = i if i > 1 else 1
        best, err = 0, w[0] * p - c[0]
        for d in range(1, k):
            e = w[d] * p - c[d]
            if e > err:
                best, err = d, e
        src[i - start] = best
        idx[i - start] = c[best]
        c[best] += 1
    return src, idx, c


@dataclass(eq=False)
class Blend:
    """Where every global position of a blend reads from (see the module's doc)."""

    names: list[str]
    weights: list[float]
    sizes: list[int]
    """Train rows of each source."""
    seed: int
    _starts: dict[int, list[int]] = field(default_factory=dict)
    """Per-source counts at the start of each block computed so far."""

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    @property
    def fingerprint(self) -> str:
        """Changes whenever the order of any later batch would."""
        body = json.dumps([self.names, self.weights, self.sizes, self.seed])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def global_batch(self, step: int, global_batch_size: int) -> list[int]:
        """Rows (of the concatenated train set) of global batch ``step``."""
        positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size)
        src, k = self.positions(int(positions[0]), len(positions))
        rows = np.empty(len(positions), np.int64)
        offsets = self.offsets
        for d in np.unique(src):
            mine = src == d
            rows[mine] = offsets[d] + _source_rows(self.sizes[d], _source_seed(self.seed, int(d)), k[mine])
        return rows.tolist()

    def positions(self, start: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample index within the source) of positions ``[start, start + size)``."""
        parts = [self._block(b) for b in range(start // BLOCK, (start + size - 1) // BLOCK + 1)]
        src = np.concatenate([p[0] for p in parts])
        idx = np.concatenate([p[1] for p in parts])
        at = start - start // BLOCK * BLOCK
        return src[at:at + size], idx[at:at + size]

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        return _cached_block(tuple(self.weights), b, tuple(self._counts_at(b)))

    def _counts_at(self, b: int) -> list[int]:
        """Per-source counts at the start of block ``b``, from the nearest block start known before it."""
        self._starts.setdefault(0, [0] * len(self.weights))
        known = max(k for k in self._starts if k <= b)
        counts = self._starts[known]
        for block in range(known, b):
            _, _, counts = blend_block(self.weights, block * BLOCK, counts, BLOCK)
            self._starts[block + 1] = counts
        return counts

    def source_of(self, rows: list[int]) -> np.ndarray:
        return np.searchsorted(np.cumsum(self.sizes), np.asarray(rows, np.int64), side="right")


@lru_cache(maxsize=4)
def _cached_block(weights: tuple, b: int, counts: tuple) -> tuple[np.ndarray, np.ndarray]:
    src, idx, _ = blend_block(list(weights), b * BLOCK, list(counts), BLOCK)
    return src, idx


def _source_seed(seed: int, source: int) -> int:
    mixed = hashlib.sha256(f"{seed}/source/{source}".encode()).digest()
    return int.from_bytes(mixed[:8], "little") & (2**63 - 1)


def _source_rows(size: int, seed: int, k: np.ndarray) -> np.ndarray:
    """Row of the k-th sample of a source of ``size`` rows: per-epoch permutations, as one source's order."""
    epochs, offsets = np.divmod(k, size)
    out = np.empty_like(k)
    for epoch in np.unique(epochs):
        mine = epochs == epoch
        out[mine] = _epoch_permutation(size, seed, int(epoch))[offsets[mine]]
    return out


def source_names(parts: list[str]) -> list[str]:
    """Short names for metrics: each part's file stem, made unique by its position."""
    stems = [Path(p.strip().rstrip("/")).name.split(".")[0] or f"source{i}" for i, p in enumerate(parts)]
    return [s if stems.count(s) == 1 else f"{s}#{i}" for i, s in enumerate(stems)]


def blend_weights(cfg: RunConfig) -> list[float]:
    """``data.weights`` normalized to sum 1, after the checks: one per ``data.path`` part, each > 0."""
    d = cfg.data
    parts = [p.strip() for p in d.path.split(",") if p.strip()]
    if len(d.weights) != len(parts):
        raise DataError(f"data.weights has {len(d.weights)} weights and data.path {len(parts)} comma-separated "
                        f"sources ({parts}); give one weight per source")
    if len(parts) < 2:
        raise DataError("data.weights blends several sources; data.path names one: drop data.weights")
    bad = [w for w in d.weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise DataError(f"data.weights={d.weights}: {bad[0]} is not a positive number; every source needs a weight "
                        "> 0 (drop a source from data.path rather than weighting it 0)")
    if d.template == "preference":
        raise DataError("data.weights with data.template=preference: DPO scores every pair of one source before "
                        "training; blend the pairs into one file instead")
    return [w / sum(d.weights) for w in d.weights]


def prepare_blend(cfg: RunConfig, tokenizer: "PreTrainedTokenizerBase",
                  prepare_data: Callable[[RunConfig, "PreTrainedTokenizerBase"], PackedData]) -> PackedData:
    """Each source prepared (by ``prepare_data``) as a run on it alone would, then concatenated with the
    blend's order."""
    weights = blend_weights(cfg)
    parts = [p.strip() for p in cfg.data.path.split(",") if p.strip()]
    sources = []
    for part in parts:
        alone = cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": part, "weights": None})})
        sources.append(prepare_data(alone, tokenizer))
    train = datasets.concatenate_datasets([s.train for s in sources])
    evals = [s.eval for s in sources if s.eval is not None]
    blend = Blend(names=source_names(parts), weights=weights, sizes=[len(s.train) for s in sources],
                  seed=cfg.train.seed)
    return PackedData(train=train, eval=datasets.concatenate_datasets(evals) if evals else None,
                      num_tokens=sum(s.num_tokens for s in sources),
                      num_documents=sum(s.num_documents for s in sources), packing=cfg.data.packing_mode,
                      num_overflow=sum(s.num_overflow for s in sources), blend=blend)
