"""One cache folder for every cache the toolkit keeps (toolkit/storage/cache.py): the default data
cache, demo tokenizers, py-cpuinfo's answer and DeepSpeed's JIT-built ops all follow the same rule,
so a user who moves it (TOOLKIT_CACHE_DIR, XDG_CACHE_HOME) moves all of them (the demo tokenizers:
tests/test_data.py::test_demo_tokenizer_is_deterministic_and_cached)."""
from __future__ import annotations

from pathlib import Path

from toolkit.compat import cpuinfo_cache, torch_extensions
from toolkit.config import load_config
from toolkit.data.base import data_cache_dir
from toolkit.storage.cache import cache_root


def _every_cache() -> dict[str, Path]:
    return {"data": data_cache_dir(load_config()), "cpuinfo": cpuinfo_cache._cache_file().parent,
            "torch_extensions": torch_extensions.extensions_dir().parent}


def test_the_rule_toolkit_cache_dir_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TOOLKIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "toolkit"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty means unset (XDG base directory spec)
    assert cache_root() == tmp_path / "home" / ".cache" / "toolkit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "toolkit"
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_every_cache_lives_under_toolkit_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    assert _every_cache() == {name: tmp_path / name for name in ("data", "cpuinfo", "torch_extensions")}


def test_every_cache_lives_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TOOLKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _every_cache() == {name: tmp_path / "toolkit" / name for name in ("data", "cpuinfo", "torch_extensions")}
