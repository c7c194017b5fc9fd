"""What a user wrote, read strictly and explained: the YAML of a run config (UTF-8, a bad byte located;
a key given twice refused; numbers as YAML 1.2 reads them, ``1e-4`` is a number; every mistake as
``FILE:LINE:COLUMN: problem``), and pydantic's validation errors as sentences naming the key, the value
and what it means. ``toolkit.config`` reads config files, ``--set`` values and presets with it."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel


class ConfigError(ValueError):
    """A user-facing configuration problem; the message says what to change (``toolkit.config`` exports it)."""


def read_yaml_file(path: Path) -> Any:
    """The YAML document of a config file; a directory, a missing file, a byte that is not UTF-8 or a
    YAML mistake is named with its place."""
    return parse_yaml(_read_text(path), str(path))


def _read_text(path: Path) -> str:
    """The config file as UTF-8 text; a directory, a missing file or a byte that is not UTF-8 is named."""
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        hint = f"give a file in it ({', '.join(inside)})" if inside else "it holds no .yaml file"
        raise ConfigError(f"config {path} is a directory, not a YAML file; {hint}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    return decode_utf8(data, str(path))


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text (a leading BOM dropped); a byte that is not UTF-8 is located."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, column = line_and_column(data, exc.start)
        raise ConfigError(f"{where}:{line}:{column}: byte 0x{data[exc.start]:02x} is not UTF-8; save the file "
                          "as UTF-8") from None


def line_and_column(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and (byte) column of ``offset`` in ``data``."""
    newline = b"\n"
    return data.count(newline, 0, offset) + 1, offset - (data.rfind(newline, 0, offset) + 1) + 1


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but numbers in exponent form without a dot (``1e-4``) are floats, as YAML
    1.2 reads them (1.1 reads text), and a key given twice in one mapping is an error, not a silent
    last-one-wins."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if seen is not key_node.start_mark:
                raise _DuplicateKey(problem=f"duplicate key {key!r} (first at line {seen.line + 1})",
                                    problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))


def parse_yaml(text: str, where: str, line_numbers: bool = True) -> Any:
    """YAML as a run config is read (``_YamlLoader``: presets and ``--set`` values too); errors as
    ``WHERE:LINE:COLUMN: problem``."""
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem if isinstance(exc, _DuplicateKey) else f"not valid YAML: {exc.problem or exc.context}"
        place = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark and line_numbers else where
        raise ConfigError(f"{place}: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def explain(err: dict, model: type[BaseModel]) -> str:
    """One pydantic error of validating ``model`` as the key, its value, what was expected and, for a
    bound, what the key means (its field's ``description``)."""
    loc = ".".join(str(p) for p in err["loc"])
    kind, value = err["type"], err.get("input")
    message = err["msg"].removeprefix("Value error, ")
    if not loc or (kind == "value_error" and isinstance(value, dict)):
        return message  # a check across keys names them itself
    if kind in _BOUNDS:
        bound = next(iter(err["ctx"].values()))
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound  # 0, not 0.0
        meaning = _description(model, err["loc"])
        return f"{loc}={value!r} must be {_BOUNDS[kind]} {bound}" + (f" ({meaning})" if meaning else "")
    return f"{loc}={value!r}: {_TYPE_MESSAGES.get(kind, lambda v, e: message)(value, err)}"


def _got(value) -> str:
    return {bool: "a boolean", str: "text", float: f"{value!r}"}.get(type(value), type(value).__name__)


_TYPE_MESSAGES = {
    "int_type": lambda v, e: ("expected a whole number" if isinstance(v, float) else
                              f"expected an integer, got {_got(v)}"),
    "float_type": lambda v, e: f"expected a number, got {_got(v)}",
    "bool_type": lambda v, e: "expected true or false",
    "string_type": lambda v, e: f"expected text; quote it ('{v}')",
    "finite_number": lambda v, e: "must be a finite number",
    "literal_error": lambda v, e: f"expected one of {e['ctx']['expected']}",
    "model_type": lambda v, e: "expected a section (a mapping of keys)",
}


def _description(model: Any, loc: tuple) -> str | None:
    field = None
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        model = field.annotation
    return field.description if field else None
