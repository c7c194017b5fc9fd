"""What the data pipeline's stages share: formats, templates' constants, errors, the result."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets

from toolkit.config import DEMO_DIR, ConfigError, RunConfig
from toolkit.storage.cache import cache_root

if TYPE_CHECKING:
    pass


EOS_TOKEN = "<|endoftext|>"
"""The demo tokenizer's only special token, id 0: end of document, also used as bos and pad."""
INSTRUCTION_TEMPLATE = "### Instruction:\n{prompt}\n### Response:\n"
"""Prompt format of template ``instruction``; format a prompt the same way at inference."""
CHAT_HEADERS = {"system": "### System:\n", "user": "### Instruction:\n", "assistant": "### Response:\n"}
"""Turn headers of the fixed chat format, used when the tokenizer has no chat template. A
[user, assistant] conversation then reads exactly like template ``instruction``."""
DEMO_CORPUS = DEMO_DIR / "corpus.txt"
PACK_BATCH_DOCS = 1000
"""Documents per packing batch; each batch drops at most ``seq_len`` tokens of its tail. Even, so a
batch of preference documents (two per pair) holds whole pairs."""
_PIPELINE_VERSION = "1"  # bump when tokenized/packed output changes for the same inputs
_PREFERENCE_RECIPE = "trl-prefix-v2"  # bump when preference rows tokenize differently (v2: same answers dropped)
_DEMO_TOKENIZER_RECIPE = "bytelevel-bpe-v1"  # bump when _train_demo_tokenizer changes
_FILE_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json",
                 ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

Segment = tuple[str | None, bool]
"""Piece of a document: (text, or None for the EOS token; whether its tokens carry loss)."""


class DataError(ConfigError):
    """A user-facing data problem found before training; the message says what to change."""


@dataclass
class PackedData:
    """Packed samples. Columns of both sets: ``input_ids`` [seq_len] int, ``labels`` [seq_len]
    int (-100 = no loss), ``num_loss_tokens`` int (labels != -100 in the row); packing ``documents``
    and ``pad`` add ``document_ids`` [seq_len] int (1, 2, ... per document in the row, 0 = padding),
    ``num_tokens`` (not padding) and ``num_documents`` per row. Template ``preference`` rows hold
    whole pairs: pair ``j`` of a row (1-based) is document ``2j - 1`` (prompt + chosen) and ``2j``
    (prompt + rejected), and ``num_pairs`` counts them."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    num_tokens: int = 0
    """Tokens of all documents (EOS included) before packing."""
    num_documents: int = 0
    packing: str = "concat"
    """``data.packing_mode`` the rows were made with."""
    num_overflow: int = 0
    """Documents longer than ``data.seq_len`` (split or dropped as ``data.overflow`` says); for
    template ``preference``, pairs longer than ``data.seq_len`` in all (dropped)."""
    num_pairs: int | None = None
    """Template ``preference``: pairs in the source (before dropping); else None."""
    blend: Any = None
    """A blend of sources (``data.weights``): ``train``/``eval`` hold every source's rows one after the
    other, and the blend says which rows each global batch takes (``toolkit/data/blend.py``)."""
    stream: Any = None
    """``data.streaming``: the ``stream.StreamBatches`` that makes each global batch (``train`` then holds
    only its first chunk's rows, read to check the source)."""
    images: Any = None
    """A vision-language model's rows (``data/vision.py``): the ``VisionBatches`` that adds each micro-batch's
    pixels (rows then carry ``images`` and ``image_tokens`` columns)."""
    num_identical_pairs: int = 0
    """Template ``preference``: pairs whose chosen and rejected answers tokenize the same, dropped (their
    DPO margin is 0 whatever the weights: no gradient, only a diluted batch mean)."""


def data_cache_dir(cfg: RunConfig) -> Path:
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "data"
