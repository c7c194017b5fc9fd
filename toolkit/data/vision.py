"""Image-text conversations for a vision-language model (``docs/vlm.md``): rows -> documents -> packed rows,
and each micro-batch's pixels.

- Rows: ``data.template: chat`` messages whose ``content`` is text or a list of ``{"type": "text", "text"}``
  / ``{"type": "image"}`` parts, and in ``data.images_column`` the row's images in the order of its image
  parts: paths (relative to the data file's directory, or absolute), bytes, or ``{"bytes", "path"}``
  dicts (``datasets.Image``'s form). Every row is checked (image parts == images, each image readable);
  a bad one is refused naming the row and the fix, never dropped.
- Documents: the conversation rendered by the model's own processor's chat template, split into turns by
  prefix renders (``templates._template_chat``'s rule), each image placeholder expanded to the processor's
  count of image tokens for that image's size, then tokenized **whole** (a turn boundary can fall inside
  a pre-token: LLaVA's ``content + ' '`` then ``ASSISTANT:`` merges ``' A'``), so the ids are the
  processor's own; a token carries loss when it overlaps an assistant turn's characters (TRL's rule),
  never an image token or a vision marker. Documents keep their images as references (path or file
  bytes), never pixels.
- Rows: whole documents (``documents`` or ``pad``; ``concat`` would cut an image's tokens), a document
  longer than ``seq_len`` dropped and counted. Each row lists its documents' images in token order.
- Micro-batches (``VisionBatches``): the images read and run through the processor's image processor
  per micro-batch, row-major (the model scatters features into image tokens in flattened order):
  ``pixel_values`` (+ ``image_grid_thw``) beside the token tensors.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from toolkit.config import RunConfig
from toolkit.data.base import PACK_BATCH_DOCS, DataError, PackedData, data_cache_dir
from toolkit.loss import IGNORE_INDEX

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")
"""A processor's own files beside the tokenizer's (training does not change them: copied into ``hf_final/``)."""
IMAGE_FEATURE = {"path": datasets.Value("string"), "bytes": datasets.Value("binary")}


def is_vision_model(name_or_path: str) -> bool:
    """Whether ``model.name_or_path``'s config.json is a vision-language model's (a ``vision_config``)."""
    import json

    from toolkit.data.tokenizer import _local_model_dir
    where = _local_model_dir(name_or_path)
    config = where / "config.json" if where is not None else None
    return config is not None and config.is_file() and isinstance(json.loads(config.read_text()).get("vision_config"), dict)


def load_processor(name_or_path: str):
    """The model's own processor (``AutoProcessor``); without torchvision, a processor whose video
    processor needs it is built without one (``compat/vlm_processor.py``)."""
    from transformers import AutoProcessor

    from toolkit.compat.vlm_processor import image_only_processor, needs_torchvision
    path = str(Path(name_or_path).parent if Path(name_or_path).is_file() else Path(name_or_path))
    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=False)  # a VLM of its own code: not here
    except Exception as exc:  # noqa: BLE001 - one clear message for any loader failure
        if needs_torchvision(exc):
            return image_only_processor(path)
        raise DataError(f"model.name_or_path={name_or_path!r}: the model's processor (AutoProcessor) does not "
                        f"load: {type(exc).__name__}: {exc}; a vision-language model's directory needs its "
                        "processor files (preprocessor_config.json, tokenizer, chat template)") from None


class Tokens:
    """What documents need of the processor and model config: the image token, the markers, counts."""

    def __init__(self, processor, hf_config, vision):
        from toolkit.families.vision import image_token_id, marker_ids
        self.processor, self.tok = processor, processor.tokenizer
        self.image_id = image_token_id(vision, hf_config)
        self.placeholder = self.tok.convert_ids_to_tokens(self.image_id)
        self.never_targets = {self.image_id, *marker_ids(vision, hf_config)}

    def per_image(self, sizes: list[tuple[int, int]]) -> list[int]:
        return image_token_counts(self.processor, sizes)


def image_token_counts(processor, sizes: list[tuple[int, int]]) -> list[int]:
    """Image tokens of each image of ``sizes`` ``[(height, width)]``, by the processor's own rule."""
    if not sizes:
        return []
    return [int(n) for n in processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]]


# --- rows ----------------------------------------------------------------------------------------

def _messages(value: Any, cfg: RunConfig, index: int) -> list[dict]:
    """Messages with text or part-list content; the number of image parts is counted by the caller."""
    column = cfg.data.messages_column
    ok = isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                         (isinstance(m.get("content"), str) or _parts_ok(m.get("content")))
                                         for m in value)
    if not ok or not value:
        raise DataError(f"data.messages_column={column!r}: row {index} holds {repr(value)[:80]}, not a list of "
                        "{'role': str, 'content': str or [{'type': 'text', 'text': str} | {'type': 'image'}]} "
                        "messages; fix or drop that row")
    return [{"role": m["role"], "content": _clean_parts(m["content"])} for m in value]


def _parts_ok(parts: Any) -> bool:
    return isinstance(parts, list) and all(
        isinstance(p, dict) and (p.get("type") == "image" or (p.get("type") == "text" and isinstance(p.get("text"), str)))
        for p in parts)


def _clean_parts(content):
    """Parts as the chat templates read them (Arrow fills absent struct fields with None)."""
    if isinstance(content, str):
        return content
    return [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]} for p in content]


def image_parts(messages: list[dict]) -> int:
    return sum(1 for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image")


def _image_refs(value: Any, cfg: RunConfig, index: int, base: Path | None) -> list[dict]:
    """The row's images as ``{"path", "bytes"}`` references (a relative path resolved against the data file)."""
    field = f"data.images_column={cfg.data.images_column!r}"
    items = [] if value is None else value if isinstance(value, list) else [value]
    refs = []
    for k, item in enumerate(items):
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            refs.append({"path": None, "bytes": bytes(item)})
        elif isinstance(item, str) and item:
            path = Path(item).expanduser()
            refs.append({"path": str(path if path.is_absolute() or base is None else base / path), "bytes": None})
        else:
            raise DataError(f"{field}: row {index} image {k} is {repr(item)[:60]}, not a path or image bytes; "
                            "give a path (relative to the data file) or the file's bytes")
    return refs


def open_image(ref: dict, cfg: RunConfig, index: int | None, k: int):
    """The image of a reference, checked; errors name the row, the image and the fix."""
    from PIL import Image, UnidentifiedImageError
    where = f"data.images_column={cfg.data.images_column!r}: " + (f"row {index} " if index is not None else "") + \
        f"image {k}"
    if ref["path"] is not None and not Path(ref["path"]).is_file():
        raise DataError(f"{where}: {ref['path']} does not exist; fix the path (relative paths are read from the "
                        "data file's directory) or drop the row")
    source = ref["path"] if ref["path"] is not None else io.BytesIO(ref["bytes"])
    try:
        with Image.open(source) as probe:
            probe.verify()
        image = Image.open(source if ref["path"] is not None else io.BytesIO(ref["bytes"]))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        shown = ref["path"] or f"bytes {ref['bytes'][:16]!r}"
        raise DataError(f"{where}: {shown} is not an image PIL can read ({type(exc).__name__}: {exc}); replace "
                        "it with a PNG/JPEG file or drop the row") from None
    return image.convert("RGB")


def _base_dir(cfg: RunConfig) -> Path | None:
    first = Path(cfg.data.path.split(",")[0].strip()).expanduser()
    return first.parent.resolve() if first.is_file() else (first.resolve() if first.is_dir() else None)


# --- documents -----------------------------------------------------------------------------------

def document(row: dict, index: int, cfg: RunConfig, tokens: Tokens, base: Path | None) -> dict:
    """One row -> ``ids``, ``loss`` (0/1), ``images`` (references in token order), ``image_tokens``."""
    from toolkit.data.templates import _template_chat
    messages = _messages(row.get(cfg.data.messages_column), cfg, index)
    refs = _image_refs(row.get(cfg.data.images_column), cfg, index, base)
    parts = image_parts(messages)
    if parts != len(refs):
        raise DataError(f"row {index}: {parts} image part(s) in data.messages_column={cfg.data.messages_column!r} "
                        f"but {len(refs)} image(s) in data.images_column={cfg.data.images_column!r}; give one image "
                        "per {'type': 'image'} part, in order, or drop the row")
    if parts == 0:
        raise DataError(f"row {index} has no image: every document needs one (a micro-batch without images on one "
                        "rank would skip the vision tower that other ranks run: ZeRO-3's parameter gathers then "
                        "differ and hang; text-only rows need a dummy-image path, not built yet): add an image or "
                        "drop the row")
    sizes = [open_image(ref, cfg, index, k).size[::-1] for k, ref in enumerate(refs)]  # (height, width)
    counts = tokens.per_image(sizes)
    segments = _template_chat(messages, tokens.processor, index)
    text, spans, used = "", [], 0
    for piece, carries in segments:
        piece, n = _expand(piece, tokens.placeholder, counts[used:])
        used += n
        if carries:
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    encoded = tokens.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    loss = [int(tid not in tokens.never_targets and any(a < e and s < b for s, e in spans))
            for tid, (a, b) in zip(ids, encoded["offset_mapping"])]
    return {"ids": ids, "loss": loss, "images": refs, "image_tokens": counts}


def _expand(text: str, placeholder: str, counts: list[int]) -> tuple[str, int]:
    """Each ``placeholder`` in ``text`` repeated its image's count of tokens (the processor's own expansion)."""
    pieces = text.split(placeholder)
    out = [pieces[0]]
    for k, rest in enumerate(pieces[1:]):
        out += [placeholder * counts[k], rest]
    return "".join(out), len(pieces) - 1


def tokenize_fn(cfg: RunConfig, tokens: Tokens):
    base = _base_dir(cfg)

    def tokenize(batch: dict, indices: list[int]) -> dict:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        docs = [document(row, i, cfg, tokens, base) for row, i in zip(rows, indices)]
        return {k: [d[k] for d in docs] for k in ("ids", "loss", "images", "image_tokens")}
    return tokenize


# --- packing -------------------------------------------------------------------------------------

def pack_vision_documents(ids: np.ndarray, loss: np.ndarray, lengths: np.ndarray, images: list, counts: list,
                          seq_len: int, mode: str) -> dict:
    """``pack.pack_documents``' rows of whole documents (one longer than ``seq_len`` dropped), each row
    with its documents' ``images`` and ``image_tokens`` in token order."""
    from toolkit.data.pack import _gather_rows, _targets, _with_counts, fit_rows
    targets = _targets(ids, loss)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]).astype(np.int64)
    pairs = np.maximum(lengths.astype(np.int64) - 1, 0)
    has_loss = np.cumsum(np.append(0, targets != IGNORE_INDEX))
    kept = np.flatnonzero((pairs > 0) & (pairs <= seq_len) & (has_loss[starts + pairs] - has_loss[starts] > 0))
    rows = fit_rows(pairs[kept], seq_len) if mode == "documents" else [[i] for i in range(len(kept))]
    out = _with_counts(_gather_rows(ids, targets, starts[kept], pairs[kept], rows, seq_len), rows)
    out = {k: v.tolist() for k, v in out.items()}
    out["images"] = [[ref for p in row for ref in images[kept[p]]] for row in rows]
    out["image_tokens"] = [[n for p in row for n in counts[kept[p]]] for row in rows]
    return out


def _pack_fn(seq_len: int, mode: str):
    def pack(batch: dict) -> dict:
        lengths = np.array([len(x) for x in batch["ids"]], dtype=np.int64)
        flat = lambda col, dtype: np.array([t for x in batch[col] for t in x], dtype=dtype)  # noqa: E731
        return pack_vision_documents(flat("ids", np.int32), flat("loss", np.int8), lengths, batch["images"],
                                     batch["image_tokens"], seq_len, mode)
    return pack


def _features(seq_len: int | None) -> datasets.Features:
    row = datasets.List(datasets.Value("int32"), length=seq_len) if seq_len else None
    images = {"images": datasets.List(IMAGE_FEATURE), "image_tokens": datasets.List(datasets.Value("int32"))}
    if row is None:
        return datasets.Features({"ids": datasets.List(datasets.Value("int32")),
                                  "loss": datasets.List(datasets.Value("int8")), **images})
    return datasets.Features({"input_ids": row, "labels": row, "document_ids": row,
                              "num_loss_tokens": datasets.Value("int32"), "num_tokens": datasets.Value("int32"),
                              "num_documents": datasets.Value("int32"), **images})


def processor_key(processor) -> str:
    """The tokenizer, chat template and image processor: what the documents depend on besides the rows."""
    from toolkit.data.pack import _key, _tokenizer_key
    return _key(_tokenizer_key(processor.tokenizer), processor.chat_template,
                processor.image_processor.to_json_string())


def prepare_vision(cfg: RunConfig) -> PackedData:
    """``pack.prepare_source`` for a vision-language model: rows checked, documents, packed rows, eval split."""
    from transformers import AutoConfig

    from toolkit.data.pack import _check_enough, _key, _split_eval
    from toolkit.data.sources import load_source
    from toolkit.data.tokenizer import _local_model_dir
    from toolkit.families.vision import find_vision
    d = cfg.data
    hf_config = AutoConfig.from_pretrained(str(_local_model_dir(cfg.model.name_or_path)), trust_remote_code=False)
    processor = load_processor(cfg.model.name_or_path)
    tokens = Tokens(processor, hf_config, find_vision(hf_config.model_type))
    source = load_source(cfg)
    missing = [c for c in (d.messages_column, d.images_column) if c not in source.column_names]
    if missing:
        raise DataError(f"data.path={d.path!r} has no column {missing[0]!r} (data.messages_column / "
                        f"data.images_column); columns present: {source.column_names}")
    source = source.select_columns([d.messages_column, d.images_column])
    key = _key("vision-tokenize", source._fingerprint, processor_key(processor), d.messages_column, d.images_column,
               _images_stamp(source, cfg))
    docs = source.map(tokenize_fn(cfg, tokens), batched=True, with_indices=True, remove_columns=source.column_names,
                      features=_features(None), desc="tokenize (images)", num_proc=d.num_proc if d.num_proc > 1 else None,
                      cache_file_name=str(data_cache_dir(cfg) / "tokenized" / f"{key}.arrow"), new_fingerprint=key)
    mode = d.packing_mode
    pkey = _key("vision-pack", docs._fingerprint, d.seq_len, PACK_BATCH_DOCS, mode)
    packed = docs.map(_pack_fn(d.seq_len, mode), batched=True, batch_size=PACK_BATCH_DOCS,
                      remove_columns=docs.column_names, features=_features(d.seq_len), desc=f"pack ({mode}, images)",
                      cache_file_name=str(data_cache_dir(cfg) / "packed" / f"{pkey}.arrow"), new_fingerprint=pkey)
    lengths = np.array([len(x) for x in docs["ids"]], dtype=np.int64)
    overflow = int((lengths - 1 > d.seq_len).sum())
    train, evals = _split_eval(packed, cfg)
    _check_enough(train, evals, int(lengths.sum()), len(docs), cfg)
    return PackedData(train=train, eval=evals, num_tokens=int(lengths.sum()), num_documents=len(docs),
                      packing=mode, num_overflow=overflow, images=VisionBatches(processor, tokens.image_id, cfg))


def _images_stamp(source: datasets.Dataset, cfg: RunConfig) -> list:
    """(size, mtime) of every image file the rows name: a changed file prepares the documents again."""
    base, stamps = _base_dir(cfg), []
    for value in source[cfg.data.images_column]:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item:
                path = Path(item).expanduser()
                path = path if path.is_absolute() or base is None else base / path
                stamps.append((path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None)
    return stamps


# --- micro-batches -------------------------------------------------------------------------------

class VisionBatches:
    """Adds each micro-batch's pixels: its rows' images, row-major, through the processor's image processor."""

    def __init__(self, processor, image_id: int, cfg: RunConfig):
        self.processor, self.image_id, self.cfg = processor, image_id, cfg

    def pixels(self, rows_images: list[list[dict]], rows_counts: list[list[int]]) -> dict[str, torch.Tensor]:
        refs = [ref for row in rows_images for ref in row]
        images = [open_image(ref, self.cfg, None, k) for k, ref in enumerate(refs)]
        counts = [n for row in rows_counts for n in row]
        now = image_token_counts(self.processor, [im.size[::-1] for im in images])
        if now != counts:
            changed = next(r for r, a, b in zip(refs, now, counts) if a != b)
            raise DataError(f"image {changed['path'] or '(bytes)'} gives {now} image tokens, the prepared data "
                            f"{counts}: it changed since the data was prepared; clear data.cache_dir ("
                            f"{data_cache_dir(self.cfg)}) and run again")
        out = self.processor.image_processor(images, return_tensors="pt")  # a list: its batch, not one image
        batch = {"pixel_values": out["pixel_values"].float()}
        if "image_grid_thw" in out:
            batch["image_grid_thw"] = out["image_grid_thw"].long()
        return batch

    def copy_processor_files(self, out: Path) -> None:
        """The model directory's processor files into ``out`` (``hf_final/``), so ``AutoProcessor`` loads it
        (the processor is unchanged by training; copying needs no torchvision, saving Qwen's would)."""
        import shutil

        from toolkit.data.tokenizer import _local_model_dir
        src = _local_model_dir(self.cfg.model.name_or_path)
        for name in PROCESSOR_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, Path(out) / name)
