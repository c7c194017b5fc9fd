"""Data: a dataset source -> tokenized, packed, DP-sharded, exactly resumable batches.

Pipeline (``prepare_data``), each stage cached on disk and keyed by everything it depends on::

    source rows --check--> documents --tokenize (map)--> ids[T_doc] + loss[T_doc] --pack (map)-->
    samples: input_ids [seq_len], labels [seq_len] (-100 = no loss), num_loss_tokens

Documents. Template ``none``: ``text_column``; every token carries loss. Template ``instruction``:
``INSTRUCTION_TEMPLATE`` around ``prompt_column``, then ``response_column``; only the response and
its EOS carry loss. Template ``chat``: a list of ``{"role", "content"}`` messages in
``messages_column``, rendered with the tokenizer's chat template when it has one (else
``CHAT_HEADERS``); only assistant turns carry loss. Every document ends with EOS.

Packing (Megatron / HF ``group_texts`` style). Within one ``datasets.map`` batch of documents
(``PACK_BATCH_DOCS``), the token stream is concatenated and cut into windows of ``seq_len + 1``
tokens with stride ``seq_len``; window ``w`` gives ``input_ids = w[:-1]`` and ``labels = w[1:]``,
with labels set to -100 where the target token carries no loss. The batch's tail that does not fill
a window is dropped, and windows with no loss token at all (inside a long prompt) are dropped too,
so a global batch never has zero loss tokens.

Attention crosses document boundaries: a sample is one causal sequence, so tokens of a document
attend to the end of the previous one; only the EOS between them tells the model that a new
document starts. This is what GPT-2/Megatron pretraining does and it costs nothing. Preventing it
would need per-sample document boundaries kept through packing (e.g. a ``position_ids`` column
restarting at 0 after each EOS, or ``cu_seqlens``) *and* a model path that honours them: a
block-diagonal causal mask (memory ``[mbs, seq_len, seq_len]``) or a varlen flash-attention kernel
fed with ``position_ids``/``cu_seqlens``; the adapters would then pass that column to the model.

Batches. ``global_batch_indices`` defines the sample order for every step from (seed, step) alone,
independent of the DP size and micro-batch size, so a run resumes exactly at any layout and any
step; ``rank_micro_batches`` cuts a global batch into this rank's micro-batches. Fetching reads the
Arrow table through numpy in one call per rank and step (no per-token Python).

Concurrency. Ranks may call ``prepare_data`` together: ``datasets`` writes its caches to a temporary
file and renames it, and the demo tokenizer is written the same way; letting rank 0 go first and
the others follow after a barrier only saves their duplicated work.
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from toolkit.config import DEMO_DIR, ConfigError, RunConfig
from toolkit.device import host_batch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

IGNORE_INDEX = -100
"""Label of a position that carries no loss (what HF models' cross entropy ignores)."""
EOS_TOKEN = "<|endoftext|>"
"""The demo tokenizer's only special token, id 0: end of document, also used as bos and pad."""
INSTRUCTION_TEMPLATE = "### Instruction:\n{prompt}\n### Response:\n"
"""Prompt format of template ``instruction``; format a prompt the same way at inference."""
CHAT_HEADERS = {"system": "### System:\n", "user": "### Instruction:\n", "assistant": "### Response:\n"}
"""Turn headers of the fixed chat format, used when the tokenizer has no chat template. A
[user, assistant] conversation then reads exactly like template ``instruction``."""
DEMO_CORPUS = DEMO_DIR / "corpus.txt"
PACK_BATCH_DOCS = 1000
"""Documents per packing batch; each batch drops at most ``seq_len`` tokens of its tail."""
_PIPELINE_VERSION = "1"  # bump when tokenized/packed output changes for the same inputs
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
    int (-100 = no loss), ``num_loss_tokens`` int (labels != -100 in the row)."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    num_tokens: int = 0
    """Tokens of all documents (EOS included) before packing."""
    num_documents: int = 0


def cache_root() -> Path:
    """``$TOOLKIT_CACHE_DIR`` or ``~/.cache/toolkit``: demo tokenizers and default data cache."""
    return Path(os.environ.get("TOOLKIT_CACHE_DIR") or "~/.cache/toolkit").expanduser()


# --- tokenizer -----------------------------------------------------------------------------------

def load_tokenizer(cfg: RunConfig) -> "PreTrainedTokenizerFast":
    """``model.tokenizer`` if set; else tokenizer files next to ``model.name_or_path``; else the demo
    byte-level BPE (trained on ``toolkit/demo/corpus.txt``, vocab = the model's ``vocab_size``,
    ``<|endoftext|>`` = id 0 as eos/bos/pad), cached under ``cache_root()/tokenizers/<key>/``.

    Checks that the tokenizer has an EOS token and fits the model's embedding (``vocab_size``)."""
    model_dir = _local_model_dir(cfg.model.name_or_path)
    vocab_size = _model_vocab_size(model_dir)
    if cfg.model.tokenizer:
        tok = _load_pretrained_tokenizer(cfg.model.tokenizer, "model.tokenizer")
    elif model_dir is not None and any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        tok = _load_pretrained_tokenizer(str(model_dir), "model.name_or_path")
    elif vocab_size is None:
        raise DataError(
            f"model.name_or_path={cfg.model.name_or_path!r} has no local config.json, so the demo "
            "tokenizer's vocab_size is unknown; set model.tokenizer to a tokenizer directory or name")
    else:
        tok = _demo_tokenizer(vocab_size)
    _check_tokenizer(tok, vocab_size, cfg)
    return tok


def _local_model_dir(name_or_path: str) -> Path | None:
    """The local directory of an HF model given as a directory or a config.json path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    return None


def _model_vocab_size(model_dir: Path | None) -> int | None:
    config = model_dir / "config.json" if model_dir else None
    if config is None or not config.is_file():
        return None
    return json.loads(config.read_text()).get("vocab_size")


def _load_pretrained_tokenizer(name: str, field: str) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    local = Path(name).expanduser().is_dir()
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local)
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clear message
        where = "a local directory" if local else "not a local directory (a hub name needs network access)"
        raise DataError(f"{field}={name!r}: could not load a tokenizer ({where}): "
                        f"{type(exc).__name__}: {exc}") from exc


def _check_tokenizer(tok: "PreTrainedTokenizerBase", vocab_size: int | None, cfg: RunConfig) -> None:
    if tok.eos_token_id is None:
        raise DataError(f"the tokenizer of {cfg.model.tokenizer or cfg.model.name_or_path!r} has no "
                        "eos_token, which separates packed documents; set one in its tokenizer_config.json")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # generation and padding need one; eos is the usual stand-in
    if vocab_size is not None and len(tok) > vocab_size:
        raise DataError(
            f"the tokenizer has {len(tok)} tokens but model.name_or_path={cfg.model.name_or_path!r} has "
            f"vocab_size={vocab_size}; token ids would overflow the embedding. Use the model's own "
            "tokenizer (model.tokenizer) or a model config with a larger vocab_size")


def _demo_tokenizer(vocab_size: int) -> "PreTrainedTokenizerFast":
    """The demo BPE for ``vocab_size``, trained once and cached; identical bytes on every rank."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    corpus = DEMO_CORPUS.read_bytes()
    tag = f"|{vocab_size}|{tokenizers.__version__}|{_DEMO_TOKENIZER_RECIPE}".encode()
    final = cache_root() / "tokenizers" / hashlib.sha256(corpus + tag).hexdigest()[:16]
    if not (final / "tokenizer.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
        try:
            _train_demo_tokenizer(corpus.decode("utf-8"), vocab_size).save_pretrained(tmp)
            os.rename(tmp, final)  # atomic: readers see nothing or a complete directory
        except OSError:
            if not (final / "tokenizer.json").is_file():  # not a lost race with another rank
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(final)


def _train_demo_tokenizer(corpus: str, vocab_size: int) -> "PreTrainedTokenizerFast":
    """Byte-level BPE (GPT-2 style) on the corpus lines; deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # all 256 bytes: no unknown tokens
    lines = corpus.splitlines()
    bpe.train_from_iterator(lines, trainer, length=len(lines))
    assert bpe.token_to_id(EOS_TOKEN) == 0, "the special token must be id 0 (the demo model's eos/bos/pad)"
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, unk_token=None)


# --- source --------------------------------------------------------------------------------------

def load_source(cfg: RunConfig) -> datasets.Dataset:
    """The raw rows of ``data.path`` (one split), as ``datasets`` loads them; see ``_resolve_source``."""
    d = cfg.data
    fmt, target = _resolve_source(d.path, d.format)
    cache = str(_data_cache_dir(cfg) / "sources")
    if fmt == "disk":
        return _load_saved(target[0], d.split)
    if fmt == "hub":
        return _load_hub(target[0], d.split, cache)
    return _load_files(fmt, target, d.path, cache)


def _resolve_source(path: str, fmt: str) -> tuple[str, list[str]]:
    """(format, [files or the one directory/name]) for ``data.path`` and ``data.format``."""
    parts = [p.strip() for p in path.split(",") if p.strip()]
    if not parts:
        raise DataError("data.path is empty; give a file, a glob, a save_to_disk directory or a hub name")
    if fmt == "hub":
        return "hub", [path]
    if fmt == "disk" and len(parts) > 1:
        raise DataError(f"data.format='disk' takes one save_to_disk directory; data.path lists {len(parts)}")
    if fmt == "disk" or (fmt == "auto" and len(parts) == 1 and _is_saved_dataset(parts[0])):
        return "disk", [parts[0]]
    files, missing = _expand_paths(parts)
    if missing:
        if fmt == "auto" and len(parts) == 1 and _looks_like_hub_name(parts[0]):
            return "hub", parts
        raise DataError(f"data.path: {', '.join(missing)} not found (working directory {os.getcwd()}); "
                        "give existing files, a glob, a save_to_disk directory, or a hub name")
    return (fmt if fmt != "auto" else _infer_format(files)), files


def _expand_paths(parts: list[str]) -> tuple[list[str], list[str]]:
    files, missing = [], []
    for part in parts:
        path = Path(part).expanduser()
        if glob.has_magic(part):
            matches = sorted(m for m in glob.glob(str(path), recursive=True) if Path(m).is_file())
            files += matches
            missing += [] if matches else [f"{part} (matches no file)"]
        elif path.is_dir():
            inside = sorted(str(p) for p in path.iterdir() if _file_format(p.name))
            files += inside
            missing += [] if inside else [f"{part} (a directory with no data files)"]
        elif path.is_file():
            files.append(str(path))
        else:
            missing.append(part)
    return files, missing


def _is_saved_dataset(path: str) -> bool:
    p = Path(path).expanduser()
    return p.is_dir() and any((p / f).is_file() for f in ("state.json", "dataset_dict.json"))


def _looks_like_hub_name(path: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path)) and _file_format(path) is None


def _file_format(name: str) -> str | None:
    suffixes = [s for s in Path(name).suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
    return _FILE_FORMATS.get(suffixes[-1].lower()) if suffixes else None


def _infer_format(files: list[str]) -> str:
    formats = {f: _file_format(f) for f in files}
    unknown = [f for f, fmt in formats.items() if fmt is None]
    if unknown:
        raise DataError(f"data.path: cannot tell the format of {unknown[0]} from its extension; set "
                        "data.format to text, json, csv or parquet")
    if len(set(formats.values())) > 1:
        raise DataError(f"data.path mixes formats {sorted(set(formats.values()))}; give files of one format")
    return next(iter(formats.values()))


def _load_files(fmt: str, files: list[str], path: str, cache: str) -> datasets.Dataset:
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"data.path={path!r} is empty (0 bytes); it needs at least one document")
    try:
        return datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=cache)
    except Exception as exc:  # noqa: BLE001 - parser errors of every format become one message
        cause = exc.__cause__ or exc
        raise DataError(f"data.path={path!r} could not be read as {fmt} (data.format): "
                        f"{type(cause).__name__}: {cause}") from exc


def _load_saved(path: str, split: str) -> datasets.Dataset:
    try:
        loaded = datasets.load_from_disk(str(Path(path).expanduser()))
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"data.path={path!r} is not a readable save_to_disk directory: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"data.split={split!r} is not in {path}; its splits are {list(loaded)}")
        return loaded[split]
    return loaded


def _load_hub(name: str, split: str, cache: str) -> datasets.Dataset:
    from huggingface_hub import constants

    offline = f"data.path={name!r} is read as a hub dataset, which needs network access"
    fix = ("; download it on a connected machine and save_to_disk it, or point data.path at local "
           "files (a path that does not exist locally is taken as a hub name)")
    if datasets.config.HF_HUB_OFFLINE:
        raise DataError(f"{offline}, but HF_HUB_OFFLINE is set{fix}")
    try:  # fail in milliseconds rather than after the hub client's retries
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError as exc:
        raise DataError(f"{offline}, but {constants.ENDPOINT} cannot be resolved ({exc}){fix}") from exc
    try:
        return datasets.load_dataset(name, split=split, cache_dir=cache)
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{offline}; loading it failed: {type(exc).__name__}: {exc}{fix}") from exc


# --- checks --------------------------------------------------------------------------------------

def _required_columns(cfg: RunConfig) -> dict[str, str]:
    """{config field: column} the template reads."""
    d = cfg.data
    if d.template == "instruction":
        return {"data.prompt_column": d.prompt_column, "data.response_column": d.response_column}
    if d.template == "chat":
        return {"data.messages_column": d.messages_column}
    return {"data.text_column": d.text_column}


def _check_rows(ds: datasets.Dataset, cfg: RunConfig) -> None:
    """Raise DataError for an empty source, a missing column, or a text column holding non-text."""
    where = f"data.path={cfg.data.path!r}"
    if len(ds) == 0:
        raise DataError(f"{where} has no rows (data.split={cfg.data.split!r}); it needs at least one document")
    for field, column in _required_columns(cfg).items():
        if column not in ds.column_names:
            raise DataError(f"{field}={column!r} is not a column of {where}; columns present: "
                            f"{ds.column_names}. Set {field} to one of them (data.template={cfg.data.template!r})")
        if field != "data.messages_column":
            _check_text_column(ds, field, column)


def _check_text_column(ds: datasets.Dataset, field: str, column: str) -> None:
    """String columns are checked in Arrow (nulls only); others row by row up to the first bad one
    (e.g. ``datasets.Json`` columns, which JSON files with mixed value types load as)."""
    feature = ds.features[column]
    if ds._indices is None and isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        nulls = ds.data.column(column).is_null().to_numpy(zero_copy_only=False)
        if nulls.any():
            raise _non_text(field, column, int(np.flatnonzero(nulls)[0]), None)
        return
    for start in range(0, len(ds), 10_000):
        values = ds[start:start + 10_000][column]
        for offset, value in enumerate(values):
            if not isinstance(value, str):
                raise _non_text(field, column, start + offset, value)


def _non_text(field: str, column: str, row: int, value: Any) -> DataError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return DataError(f"{field}={column!r}: row {row} holds {type(value).__name__} {shown}, not text; "
                     "fix or drop that row, or point the field at a text column")


# --- tokenize ------------------------------------------------------------------------------------

def _document_segments(row: dict, index: int, cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> list[Segment]:
    """One source row as loss-flagged text pieces ending with EOS; [] for an empty text document."""
    d = cfg.data
    if d.template == "none":
        text = _text(row, d.text_column, "data.text_column", index)
        return [(text, True), (None, True)] if text else []
    if d.template == "instruction":
        prompt = _text(row, d.prompt_column, "data.prompt_column", index)
        response = _text(row, d.response_column, "data.response_column", index)
        return [(INSTRUCTION_TEMPLATE.format(prompt=prompt), False), (response, True), (None, True)]
    messages = _messages(row.get(d.messages_column), d.messages_column, index)
    segments = _template_chat(messages, tok, index) if tok.chat_template else _fixed_chat(messages)
    if not segments or segments[-1][0] is None:
        return segments
    return segments + [(None, segments[-1][1])]  # EOS learnt only after an assistant turn


def _text(row: dict, column: str, field: str, index: int) -> str:
    value = row.get(column)
    if not isinstance(value, str):
        raise _non_text(field, column, index, value)
    return value


def _messages(value: Any, column: str, index: int) -> list[dict]:
    if isinstance(value, dict) and isinstance(value.get("role"), list):  # legacy Sequence({...}) layout
        value = [dict(zip(value, turn)) for turn in zip(*value.values())]
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        shown = repr(value)[:80]
        raise DataError(f"data.messages_column={column!r}: row {index} holds {type(value).__name__} "
                        f"{shown}, not a list of {{'role': str, 'content': str}} messages")
    return value


def _fixed_chat(messages: list[dict]) -> list[Segment]:
    """``CHAT_HEADERS`` format; an assistant turn ends with EOS so the model learns to stop."""
    segments: list[Segment] = []
    for m in messages:
        header = CHAT_HEADERS.get(m["role"], f"### {m['role'].capitalize()}:\n")
        if m["role"] == "assistant":
            segments += [(header, False), (m["content"], True), (None, True)]
        else:
            segments += [(header + m["content"] + "\n", False)]
    return segments


def _template_chat(messages: list[dict], tok: "PreTrainedTokenizerBase", index: int) -> list[Segment]:
    """Split the tokenizer's chat template rendering into turns: assistant turns (after their
    generation prompt) carry loss. Needs a template whose rendering of a conversation prefix is a
    prefix of the full rendering, which is what generation with it relies on too."""
    segments: list[Segment] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            head = _render(tok, messages[:k], True, index)
            segments.append((_suffix(head, done, index), False))
            done = head
        full = _render(tok, messages[:k + 1], False, index)
        segments.append((_suffix(full, done, index), message["role"] == "assistant"))
        done = full
    return [s for s in segments if s[0]]


def _render(tok: "PreTrainedTokenizerBase", messages: list[dict], generation_prompt: bool, index: int) -> str:
    if not messages:
        return ""
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja errors name the template, not the row
        raise DataError(f"data.messages_column: the tokenizer's chat template failed on row {index}: "
                        f"{exc}") from exc


def _suffix(text: str, prefix: str, index: int) -> str:
    if not text.startswith(prefix):
        raise DataError(
            f"data.template='chat': row {index}: the tokenizer's chat template renders a conversation "
            "prefix differently from the full conversation, so assistant turns cannot be located; "
            "use a tokenizer without a chat template (fixed format) or template 'instruction'")
    return text[len(prefix):]


def _tokenize_fn(cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> Callable[[dict, list[int]], dict]:
    """Batched map function: rows -> per-document ``ids`` [T_doc] and ``loss`` [T_doc] (0/1: does
    this token carry loss as a prediction target). Segments are tokenized separately so the loss
    boundary falls exactly between prompt and response, as the prompt is tokenized alone at inference."""
    eos = tok.eos_token_id

    def tokenize(batch: dict, indices: list[int]) -> dict:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        docs = [_document_segments(row, i, cfg, tok) for row, i in zip(rows, indices)]
        texts = [text for doc in docs for text, _ in doc if text]
        encoded = iter(tok(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else [])
        out: dict[str, list] = {"ids": [], "loss": []}
        for doc in [d for d in docs if d]:
            ids, loss = [], []
            for text, carries_loss in doc:
                piece = [eos] if text is None else (next(encoded) if text else [])
                ids += piece
                loss += [int(carries_loss)] * len(piece)
            out["ids"].append(ids)
            out["loss"].append(loss)
        return out

    return tokenize


# --- pack ----------------------------------------------------------------------------------------

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
    _check_rows(source, cfg)
    source = source.select_columns(list(_required_columns(cfg).values()))
    docs = _tokenize(source, cfg, tokenizer)
    packed = _pack(docs, cfg)
    num_tokens = int(pc.sum(pc.list_value_length(docs.data.column("ids"))).as_py() or 0)
    train, evals = _split_eval(packed, cfg)
    _check_enough(train, evals, num_tokens, len(docs), cfg)
    return PackedData(train=train, eval=evals, num_tokens=num_tokens, num_documents=len(docs))


def _data_cache_dir(cfg: RunConfig) -> Path:
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else cache_root() / "data"


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([_PIPELINE_VERSION, *parts], default=str).encode()).hexdigest()[:20]


def _tokenizer_key(tok: "PreTrainedTokenizerBase") -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else datasets.fingerprint.Hasher.hash(tok)
    return _key(type(tok).__name__, body, tok.eos_token_id, tok.chat_template)


def _tokenize(source: datasets.Dataset, cfg: RunConfig, tok: "PreTrainedTokenizerBase") -> datasets.Dataset:
    d = cfg.data
    recipe = (d.template, _required_columns(cfg), INSTRUCTION_TEMPLATE, CHAT_HEADERS)
    key = _key("tokenize", source._fingerprint, _tokenizer_key(tok), recipe)
    features = datasets.Features({"ids": datasets.List(datasets.Value("int32")),
                                  "loss": datasets.List(datasets.Value("int8"))})
    return source.map(
        _tokenize_fn(cfg, tok), batched=True, with_indices=True, remove_columns=source.column_names,
        features=features, num_proc=d.num_proc if d.num_proc > 1 else None, desc="tokenize",
        cache_file_name=str(_data_cache_dir(cfg) / "tokenized" / f"{key}.arrow"), new_fingerprint=key)


def _pack(docs: datasets.Dataset, cfg: RunConfig) -> datasets.Dataset:
    key = _key("pack", docs._fingerprint, cfg.data.seq_len, PACK_BATCH_DOCS)
    return docs.with_format("arrow").map(
        _pack_fn(cfg.data.seq_len), batched=True, batch_size=PACK_BATCH_DOCS,
        remove_columns=docs.column_names, features=_packed_features(cfg.data.seq_len), desc="pack",
        cache_file_name=str(_data_cache_dir(cfg) / "packed" / f"{key}.arrow"),
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
        raise DataError(f"data.path={d.path!r}: every document is empty ({_required_columns(cfg)} hold "
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


# --- batches -------------------------------------------------------------------------------------

def global_batch_indices(num_samples: int, global_batch_size: int, seed: int, step: int) -> list[int]:
    """Sample indices of global batch ``step`` (0-based), ``global_batch_size`` of them.

    The order is the endless concatenation of per-epoch permutations (epoch ``e`` permuted by a
    ``torch.Generator`` seeded from (seed, e)); batch k is positions [k*G, (k+1)*G) of that stream,
    so a batch may straddle an epoch boundary. Depends on nothing else: not DP size, not
    micro-batch size, not earlier steps."""
    if num_samples < 1 or global_batch_size < 1 or step < 0:
        raise ValueError(f"need num_samples>=1, global_batch_size>=1, step>=0; got {num_samples}, "
                         f"{global_batch_size}, {step}")
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size)
    epochs, offsets = np.divmod(positions, num_samples)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        out[in_epoch] = _epoch_permutation(num_samples, seed, int(epoch))[offsets[in_epoch]]
    return out.tolist()


@lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """``[num_samples]`` permutation of epoch ``epoch``; cached because consecutive steps share it."""
    mixed = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()  # independent streams per epoch
    gen = torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") & (2**63 - 1))
    perm = torch.randperm(num_samples, generator=gen).numpy()
    perm.flags.writeable = False
    return perm


def rank_micro_batches(ds: datasets.Dataset, indices: list[int], dp_rank: int, dp_size: int,
                       micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of a global batch: rank r takes the r-th contiguous slice of
    ``indices`` (``len(indices) / dp_size`` samples), split in order into micro-batches, each
    ``{"input_ids": LongTensor [mbs, seq_len], "labels": LongTensor [mbs, seq_len]}``."""
    per_rank, rest = divmod(len(indices), dp_size)
    if rest or per_rank % micro_batch_size or not 0 <= dp_rank < dp_size:
        raise ValueError(f"{len(indices)} indices cannot be split over dp_size={dp_size} ranks "
                         f"(dp_rank={dp_rank}) in micro-batches of {micro_batch_size}; the global batch "
                         "size must be a multiple of micro_batch_size x dp")
    return _fetch(ds, indices[dp_rank * per_rank:(dp_rank + 1) * per_rank], micro_batch_size)


def _fetch(ds: datasets.Dataset, indices: list[int], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """One Arrow ``take`` for all of this rank's rows, then views per micro-batch."""
    if not len(indices):
        return []
    rows = ds.with_format("numpy", columns=["input_ids", "labels"])[[int(i) for i in indices]]
    input_ids = torch.from_numpy(np.ascontiguousarray(rows["input_ids"], dtype=np.int64))
    labels = torch.from_numpy(np.ascontiguousarray(rows["labels"], dtype=np.int64))
    return [host_batch({"input_ids": input_ids[i:i + micro_batch_size], "labels": labels[i:i + micro_batch_size]})
            for i in range(0, len(indices), micro_batch_size)]


def count_loss_tokens(ds: datasets.Dataset, indices: list[int]) -> int:
    """Labels != -100 over these samples, from the ``num_loss_tokens`` column (no token reads);
    the trainer divides the summed loss of a global batch by this on every rank."""
    if not len(indices):
        return 0
    column = ds.with_format("numpy", columns=["num_loss_tokens"])[[int(i) for i in indices]]
    return int(column["num_loss_tokens"].sum())


def eval_micro_batches(ds: datasets.Dataset | None, dp_rank: int, dp_size: int, micro_batch_size: int,
                       max_batches: int) -> list[dict[str, torch.Tensor]]:
    """Up to ``max_batches`` micro-batches per rank from the first samples of ``ds`` in fixed
    order, sliced across ranks like ``rank_micro_batches``. Only full micro-batches on every rank
    are used (all ranks must run the same number of equal-shaped forwards), so a set smaller than
    ``dp_size * micro_batch_size`` gives []; ``prepare_data`` keeps at least a global batch."""
    if ds is None:
        return []
    per_step = dp_size * micro_batch_size
    n = min(len(ds), max_batches * per_step) // per_step * per_step
    return rank_micro_batches(ds, list(range(n)), dp_rank, dp_size, micro_batch_size)
