"""What a run trains on: one source read by ``datasets`` (``pack.prepare_source``), Megatron indexed
prefixes (``indexed_rows``), or a weighted blend of sources (``blend``)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import datasets

from toolkit.config import RunConfig
from toolkit.data.base import DataError, PackedData
from toolkit.data.blend import prepare_blend
from toolkit.data.indexed import prefix_of, read_sidecar
from toolkit.data.indexed_rows import packed_prefix
from toolkit.data.pack import _check_enough, _split_eval, prepare_source
from toolkit.data.stream import prepare_stream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def prepare_data(cfg: RunConfig, tokenizer: "PreTrainedTokenizerBase") -> PackedData:
    """Load ``data.path``, check it, tokenize, pack and split off eval; cached in ``data.cache_dir``.

    Raises DataError before any training for a missing source or column, an empty source, non-text
    values, a prefix that does not fit the tokenizer, or fewer packed train samples than
    ``train.global_batch_size``. A vision-language model's image-text rows: ``data/vision.py``."""
    from toolkit.data.vision import is_vision_model, prepare_vision
    if is_vision_model(cfg.model.name_or_path):
        return prepare_vision(cfg)  # the plan refused what it does not take (streaming, blends, prefixes)
    if cfg.data.streaming:
        if cfg.data.weights is not None or indexed_prefixes(cfg):
            raise DataError("data.streaming reads one source of files as it trains; a Megatron prefix is already "
                            "memory-mapped and a blend mixes whole sources: drop data.streaming")
        return prepare_stream(cfg, tokenizer)
    if cfg.data.weights is not None:
        return prepare_blend(cfg, tokenizer, _prepare_one)
    return _prepare_one(cfg, tokenizer)


def _prepare_one(cfg: RunConfig, tokenizer: "PreTrainedTokenizerBase") -> PackedData:
    prefixes = indexed_prefixes(cfg)
    if prefixes:
        return _prepare_prefixes(prefixes, cfg, tokenizer)
    return prepare_source(cfg, tokenizer)


def indexed_prefixes(cfg: RunConfig) -> list[str] | None:
    """The Megatron prefixes ``data.path`` names (``data.format`` megatron, or auto and every part is one),
    or None for other sources; a path mixing prefixes and other files is refused."""
    d = cfg.data
    if d.format not in ("auto", "megatron"):
        return None
    parts = [p.strip() for p in d.path.split(",") if p.strip()]
    found = {p: prefix_of(p) for p in parts}
    missing = [p for p, prefix in found.items() if prefix is None]
    if d.format == "megatron" and missing:
        raise DataError(f"data.format=megatron: {missing[0]!r} names no indexed dataset ({missing[0]}.bin and "
                        f"{missing[0]}.idx not found, working directory {os.getcwd()}); give the PREFIX of "
                        "PREFIX.bin + PREFIX.idx (toolkit prepare writes them)")
    if len(missing) == len(parts):
        return None
    if missing:
        raise DataError(f"data.path mixes Megatron indexed datasets ({[p for p in parts if p not in missing]}) and "
                        f"other sources ({missing}); blend them as separate sources with data.weights, or "
                        "prepare the others too (toolkit prepare)")
    if d.template == "preference":
        raise DataError("data.template=preference cannot read a Megatron indexed dataset (it holds documents, "
                        "not pairs); train DPO from the source file")
    return [found[p] for p in parts]


def _prepare_prefixes(prefixes: list[str], cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> PackedData:
    """Rows of Megatron prefixes (each packed alone, in ``data.path`` order), then the eval split."""
    for prefix in prefixes:
        recorded = (read_sidecar(prefix) or {}).get("template", cfg.data.template)
        if recorded != cfg.data.template:
            raise DataError(f"{prefix} was prepared with data.template={recorded}; this run has "
                            f"data.template={cfg.data.template}: set data.template={recorded} (its loss mask "
                            "and packing default go with it), or prepare the data again")
    packed = [packed_prefix(prefix, cfg, tok) for prefix in prefixes]
    rows = packed[0][0] if len(packed) == 1 else datasets.concatenate_datasets([p[0] for p in packed])
    num_tokens = sum(p[1]["tokens"] for p in packed)
    num_docs = sum(p[1]["documents"] for p in packed)
    train, evals = _split_eval(rows, cfg)
    _check_enough(train, evals, num_tokens, num_docs, cfg)
    return PackedData(train=train, eval=evals, num_tokens=num_tokens, num_documents=num_docs,
                      packing=cfg.data.packing_mode, num_overflow=sum(p[1]["overflow"] for p in packed))
