"""Dataset sources (local files, save_to_disk folders, the hub when online) and their row checks."""
from __future__ import annotations

import glob
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import datasets
import numpy as np

from toolkit.config import RunConfig
from toolkit.config_input import line_and_column
from toolkit.data.base import _FILE_FORMATS, DataError, data_cache_dir

if TYPE_CHECKING:
    pass


def load_source(cfg: RunConfig) -> datasets.Dataset:
    """The raw rows of ``data.path`` (one split), as ``datasets`` loads them; see ``_resolve_source``."""
    d = cfg.data
    fmt, target = _resolve_source(d.path, d.format)
    cache = str(data_cache_dir(cfg) / "sources")
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
        ds = datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=cache)
    except Exception as exc:  # noqa: BLE001 - parser errors of every format become one message
        cause = exc.__cause__ or exc
        if isinstance(cause, UnicodeDecodeError):  # the csv and text readers decode as they read
            raise _not_utf8(path, files) from None
        raise DataError(f"data.path={path!r} could not be read as {fmt} (data.format): "
                        f"{type(cause).__name__}: {cause}") from exc
    if fmt != "parquet" and not _valid_utf8(ds):  # pyarrow's JSON reader keeps invalid strings as they are
        raise _not_utf8(path, files)
    return ds


def _valid_utf8(ds: datasets.Dataset) -> bool:
    """Whether every string in the table is UTF-8 (Arrow's full validation, in C++: no row is decoded here)."""
    import pyarrow as pa
    try:
        ds.data.table.validate(full=True)
    except pa.ArrowInvalid as exc:
        if "UTF8" in str(exc):
            return False
        raise
    return True


def _not_utf8(path: str, files: list[str]) -> DataError:
    """The first byte of ``files`` that is not UTF-8, by file, line and column."""
    fix = "the data must be UTF-8 text: re-encode the file (e.g. iconv -f latin1 -t utf-8) or drop that line"
    for file in files:
        line = 1
        for block in _line_blocks(file):
            try:
                block.decode("utf-8")
            except UnicodeDecodeError as exc:
                at, column = line_and_column(block, exc.start)
                return DataError(f"data.path={path!r}: {file} line {line + at - 1}, column {column}: byte "
                                 f"0x{block[exc.start]:02x} is not UTF-8; {fix}")
            line += block.count(b"\n")
    return DataError(f"data.path={path!r} holds bytes that are not UTF-8; {fix}")


def _line_blocks(file: str, size: int = 1 << 24):
    """The bytes of ``file`` (decompressed) in blocks of whole lines, about ``size`` each: a block never
    cuts a UTF-8 sequence, which holds no newline byte."""
    import importlib
    module = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}.get(Path(file).suffix)
    with (importlib.import_module(module).open if module else open)(file, "rb") as f:
        tail = b""
        while chunk := f.read(size):
            block = tail + chunk
            cut = block.rfind(b"\n") + 1
            if cut:
                yield block[:cut]
            tail = block[cut:]
        if tail:
            yield tail


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


def stream_rows(cfg: RunConfig):
    """``data.path`` as a ``datasets.IterableDataset`` of the template's columns (nothing loaded whole)."""
    d = cfg.data
    fmt, target = _resolve_source(d.path, d.format)
    if fmt == "disk":
        loaded = datasets.load_from_disk(str(Path(target[0]).expanduser()))
        loaded = loaded[d.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        rows = loaded.to_iterable_dataset()
    elif fmt == "hub":
        rows = datasets.load_dataset(target[0], split=d.split, streaming=True)
    else:
        rows = datasets.load_dataset(fmt, data_files=target, split="train", streaming=True)
    first = next(iter(rows), None)
    if first is None:
        raise DataError(f"data.path={d.path!r} has no rows; it needs at least one document")
    for field, column in required_columns(cfg).items():
        if column not in first:
            raise DataError(f"{field}={column!r} is not a column of data.path={d.path!r}; columns present: "
                            f"{sorted(first)}. Set {field} to one of them (data.template={d.template!r})")
    return rows.select_columns(list(required_columns(cfg).values()))


# --- checks --------------------------------------------------------------------------------------

def required_columns(cfg: RunConfig) -> dict[str, str]:
    """{config field: column} the template reads."""
    d = cfg.data
    if d.template == "instruction":
        return {"data.prompt_column": d.prompt_column, "data.response_column": d.response_column}
    if d.template == "chat":
        return {"data.messages_column": d.messages_column}
    if d.template == "preference":
        return {"data.prompt_column": d.prompt_column, "data.chosen_column": d.chosen_column,
                "data.rejected_column": d.rejected_column}
    return {"data.text_column": d.text_column}


def check_rows(ds: datasets.Dataset, cfg: RunConfig) -> None:
    """Raise DataError for an empty source, a missing column, or a text column holding non-text.
    Preference columns hold text or message lists; their rows are checked as they are tokenized."""
    where = f"data.path={cfg.data.path!r}"
    if len(ds) == 0:
        raise DataError(f"{where} has no rows (data.split={cfg.data.split!r}); it needs at least one document")
    for field, column in required_columns(cfg).items():
        if column not in ds.column_names:
            raise DataError(f"{field}={column!r} is not a column of {where}; columns present: "
                            f"{ds.column_names}. Set {field} to one of them (data.template={cfg.data.template!r})")
        if field != "data.messages_column" and cfg.data.template != "preference":
            _check_text_column(ds, field, column)


def _check_text_column(ds: datasets.Dataset, field: str, column: str) -> None:
    """String columns are checked in Arrow (nulls only); others row by row up to the first bad one
    (e.g. ``datasets.Json`` columns, which JSON files with mixed value types load as)."""
    feature = ds.features[column]
    if ds._indices is None and isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        nulls = ds.data.column(column).is_null().to_numpy(zero_copy_only=False)
        if nulls.any():
            raise non_text_error(field, column, int(np.flatnonzero(nulls)[0]), None)
        return
    for start in range(0, len(ds), 10_000):
        values = ds[start:start + 10_000][column]
        for offset, value in enumerate(values):
            if not isinstance(value, str):
                raise non_text_error(field, column, start + offset, value)


def non_text_error(field: str, column: str, row: int, value: Any) -> DataError:
    return DataError(f"{field}={column!r}: row {row} holds {shown_value(value)}, not text; "
                     "fix or drop that row, or point the field at a text column")


def shown_value(value: Any) -> str:
    """A row's value for an error message: its type and its repr, cut at 60 characters."""
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"{type(value).__name__} {shown}"
