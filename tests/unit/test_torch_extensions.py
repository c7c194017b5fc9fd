"""Each Python environment builds DeepSpeed's JIT ops into a folder of its own (no rebuild ping-pong
between virtualenvs sharing torch's default folder, nor between the ninjas on PATH of one
environment's processes); a folder the user chose is kept."""
from __future__ import annotations

import sys

from toolkit.compat import torch_extensions
from toolkit.storage.cache import cache_root


def test_folder_is_per_environment_and_a_users_choice_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    mine = torch_extensions.install()
    assert mine == str(torch_extensions.extensions_dir())
    assert torch_extensions.extensions_dir().parent == cache_root() / "torch_extensions"
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert torch_extensions.extensions_dir().name.startswith("other-venv-py3")
    assert str(torch_extensions.extensions_dir()) != mine
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    assert torch_extensions.install() == str(tmp_path / "chosen")


def test_each_ninja_on_path_gets_its_own_folder(tmp_path, monkeypatch):
    """ninja 1.11 and 1.13 hash a build command differently: sharing one folder, each rebuilt every op
    the other had built (an activated venv's pip ninja against /usr/bin/ninja)."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ninja").write_text("#!/bin/sh\n")
        (tmp_path / name / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "a"))
    first = torch_extensions.extensions_dir()
    assert torch_extensions.extensions_dir() == first  # stable
    monkeypatch.setenv("PATH", str(tmp_path / "b"))
    assert torch_extensions.extensions_dir() != first
