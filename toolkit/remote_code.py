"""A model directory's own Python runs only when asked (``model.trust_remote_code``).

transformers imports the classes a directory's config.json or tokenizer_config.json names in its
``auto_map`` when it implements no class of its own for the model, and asks ``[y/N]`` on stdin when
``trust_remote_code`` is left unset: a ``y``, or a pipe, ran the directory's code. Every load in the
toolkit passes the keyword explicitly (``tests/unit/test_remote_code.py`` checks), and a refusal names
the classes and the key instead of transformers' traceback. Where transformers implements the model
itself, an ``auto_map`` is ignored and its own class is used, as transformers does.
"""
from __future__ import annotations

import json
from pathlib import Path

from toolkit.config_input import ConfigError

TRUST_KEY = "model.trust_remote_code"
DYNAMIC_MODULES = "transformers_modules"
"""The package transformers imports a directory's code under (``dynamic_module_utils``)."""


def custom_classes(directory: Path, file: str) -> list[str]:
    """``AutoX -> module.Class`` for each class ``directory/file`` names in its ``auto_map``."""
    path = Path(directory) / file
    try:
        auto_map = json.loads(path.read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return []
    named = []
    for auto, ref in auto_map.items():
        refs = [r for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if r]  # tokenizers: [slow, fast]
        named += [f"{auto} -> {r}" for r in refs]
    return named


def is_custom_code_refusal(exc: Exception) -> bool:
    """Whether transformers refused to load because the directory's code would have to run."""
    return isinstance(exc, ValueError) and "custom code" in str(exc)


def refusal(field: str, name: str, directory: Path, file: str) -> ConfigError:
    """The refusal of a directory whose ``file`` names code of its own, naming the classes and the key."""
    classes = custom_classes(directory, file)
    named = f" (auto_map: {', '.join(classes)})" if classes else ""
    return ConfigError(
        f"{field}={name!r}: {file} names custom code{named} that transformers would import and run, having no "
        f"class of its own for it; the toolkit runs a model directory's Python only when asked: read that code, "
        f"and if you trust it set {TRUST_KEY}=true")


def runs_remote_code(hf_config) -> bool:
    """Whether ``hf_config`` is of a class a model directory defined: one loaded with
    ``model.trust_remote_code`` (a config of transformers' own classes never is), whose model classes
    come from the same, trusted, directory."""
    return type(hf_config).__module__.split(".")[0] == DYNAMIC_MODULES
