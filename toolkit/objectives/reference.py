"""The reference model's log-probabilities for preference objectives, scored once before training.

DPO (``dpo.py``, whose hook this is) compares the policy's log-probability of each answer with the frozen
starting model's. Instead of holding a second model through training, the engine scores every train and eval row once, before its
first step and before a resume loads a checkpoint (so it is still the starting model; a LoRA run's
base with its adapters off), at whatever layout the run has. The per-document sums (``[rows, width]``
fp64, column d-1 for document d of the row) are cached beside the packed data, under a key of the
model's fingerprint and a sample of its weight values, its dtype and the packed sets' fingerprints
(``ReferenceScores.key``); training then holds only the policy, at supervised fine-tuning's memory. A
checkpoint records the key it was trained against (trainer.json ``reference``) and a resume refuses
other scores.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from toolkit import device
from toolkit.config import ConfigError
from toolkit.data import rank_micro_batches
from toolkit.data.base import data_cache_dir
from toolkit.storage import write_json_durable
from toolkit.storage.meta import base_model_record

SPLITS = ("train", "eval")
REF_COLUMN = "ref_logps"
"""The micro-batch column of the reference model's per-document log-probability sums."""


@dataclass
class ReferenceScores:
    """Per-document reference sums of each packed set (``scores[split]``: ``[rows, width]`` fp64)."""
    key: str
    width: int
    scores: dict[str, np.ndarray]
    unsampled_key: str | None = None
    """The key as checkpoints written before the weight sample joined it recorded it (``check_resumed``)."""

    def attach(self, split: str, micro_batches: list[dict], indices: list[int],
               batch: list[int] | None = None) -> list[dict]:
        """``micro_batches`` (this rank's, in order, of the rows ``indices``) with their ``ref_logps``
        (``objectives.base.Prepared``; each row's scores are its own: the other ranks' rows ``batch`` unread)."""
        rows, start = self.scores[split], 0
        for mb in micro_batches:
            n = len(mb["input_ids"])
            mb[REF_COLUMN] = torch.from_numpy(rows[indices[start:start + n]])
            start += n
        return micro_batches

    def check_resumed(self, saved: str | None) -> None:
        check_resumed(saved, self.key, self.unsampled_key)


def reference_key(cfg, data, sampled: bool = True) -> tuple[str, int]:
    """(the cache key of the reference scores, the document width): the model (weights' fingerprint
    and a sample of their values, config, dtype) and the packed rows (``datasets`` fingerprints of both
    sets). ``sampled=False``: the key without the sample, as checkpoints written before it recorded."""
    m = cfg.model
    sets = {s: getattr(data, s) for s in SPLITS if getattr(data, s) is not None}
    width = max(int(np.max(ds.with_format("numpy", columns=["num_documents"])["num_documents"], initial=0))
                for ds in sets.values())
    width += width % 2
    model = base_model_record(m.name_or_path, m.init, cfg.train.seed)["fingerprint"]
    config = Path(m.name_or_path) / "config.json" if Path(m.name_or_path).is_dir() else Path(m.name_or_path)
    parts = [model, config.read_text() if config.is_file() else m.name_or_path, m.dtype, width,
             {s: ds._fingerprint for s, ds in sets.items()}]
    if sampled:
        parts.insert(1, weights_sample(m.name_or_path) if m.init == "pretrained" else None)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24], width


SAMPLE_BYTES = 4096
"""Bytes read at each end of every tensor (``weights_sample``)."""


def weights_sample(name_or_path: str) -> str:
    """A digest of the base's weight values, sampled: the first and last ``SAMPLE_BYTES`` of every tensor
    of each safetensors file (16 samples of 64 KiB spread over any other weight file). The base's
    fingerprint (``base_model_record``) reads names, shapes and sizes only, which a fine-tune of the same
    model shares, so its cached scores would be taken for the fine-tune's; a fine-tune moves every
    tensor's values. Reads a few MB of a 70B model's 140 GB, and the same on every node's copy."""
    root = Path(name_or_path)
    root = root.parent if root.is_file() else root
    digest = hashlib.sha256()
    for path in sorted(p for pattern in ("*.safetensors", "*.bin") for p in root.glob(pattern) if p.is_file()):
        with open(path, "rb") as f:
            for start, stop in _sample_ranges(f, path):
                f.seek(start)
                digest.update(f.read(stop - start))
    return digest.hexdigest()[:32]


def _sample_ranges(f, path: Path) -> list[tuple[int, int]]:
    """Byte ranges of ``path`` to read: each tensor's ends (safetensors), else 16 spread over the file."""
    size = path.stat().st_size
    if path.suffix == ".safetensors" and size >= 8:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        base, ranges = 8 + header_len, []
        for name in sorted(k for k in header if k != "__metadata__"):
            start, stop = header[name]["data_offsets"]
            ranges += [(base + start, base + min(stop, start + SAMPLE_BYTES)),
                       (base + max(start, stop - SAMPLE_BYTES), base + stop)]
        return ranges
    return [(size * i // 16, min(size, size * i // 16 + 16 * SAMPLE_BYTES)) for i in range(16)]


def prepare_reference(cfg, engine, data, log=print, beat=None) -> ReferenceScores:
    """The run's reference scores: read from the cache, or scored now by ``engine`` (collective; call
    it before the engine's first step or checkpoint load) and written there by rank 0; ``beat()``
    after each micro-batch scored (the heartbeat's progress)."""
    key, width = reference_key(cfg, data)
    unsampled = reference_key(cfg, data, sampled=False)[0]
    root = data_cache_dir(cfg) / "reference" / key
    found = [(root / "meta.json").is_file()]
    dist.broadcast_object_list(found, src=0)  # one decision: rank 0's view of the cache
    if found[0]:
        scores = {s: np.load(root / f"{s}.npy") for s in SPLITS if (root / f"{s}.npy").is_file()}
        log(f"reference log-probabilities: cached {root}")
        return ReferenceScores(key, width, scores, unsampled)
    scores = {}
    for split in SPLITS:
        ds = getattr(data, split)
        if ds is not None and len(ds):
            scores[split] = score(engine, ds, width, cfg.train.micro_batch_size, beat)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for split, rows in scores.items():
            _save_npy(root / f"{split}.npy", rows)
        write_json_durable(root / "meta.json", {"key": key, "width": width, "rows": {s: len(r) for s, r in scores.items()},
                                                "model": cfg.model.name_or_path, "dtype": cfg.model.dtype})
    dist.barrier()
    log(f"reference log-probabilities: scored {sum(len(r) for r in scores.values()):,} rows, cached in {root}")
    return ReferenceScores(key, width, scores, unsampled)


def score(engine, ds, width: int, micro_batch_size: int, beat=None) -> np.ndarray:
    """``[len(ds), width]`` fp64 per-document answer log-probability sums by ``engine`` (collective): each
    DP replica scores its share of the rows (padded with row 0 to whole micro-batches on every rank),
    the holders of each result add it into a zero table, and one all-reduce gives every rank the table."""
    per_step = engine.dp_size * micro_batch_size
    padded = -(-len(ds) // per_step) * per_step
    indices = list(range(len(ds))) + [0] * (padded - len(ds))
    micro = rank_micro_batches(ds, indices, engine.dp_rank, engine.dp_size, micro_batch_size)
    table = device.zeros((padded, width), dtype=torch.float64)
    sums = engine.document_logps(micro, width, beat)
    if sums is not None:
        start = engine.dp_rank * (padded // engine.dp_size)
        table[start:start + padded // engine.dp_size] = torch.cat(sums)
    dist.all_reduce(table)
    return table[:len(ds)].cpu().numpy()


def check_resumed(saved: str | None, key: str, unsampled_key: str | None = None) -> None:
    """A checkpoint trained against other reference scores (another starting model or data) cannot go on
    with these: its DPO loss would change meaning mid-run. A checkpoint written before the weight sample
    joined the key recorded ``unsampled_key``: it resumes on what it could record (the base's names,
    shapes, config and dtype, and the data), as it did when it was written."""
    if saved is not None and saved not in (key, unsampled_key):  # a ConfigError: a refusal, which no restart would change
        raise ConfigError(f"the checkpoint was trained against reference log-probabilities {saved}, this run's "
                           f"are {key}: the starting model (model.*) or the data (data.*) changed since it was "
                           "saved; resume with the run's original settings, or start a new run_dir")


def _save_npy(path: Path, rows: np.ndarray) -> None:
    """``np.save`` to a temporary file of this writer's own, then renamed into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, rows)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
