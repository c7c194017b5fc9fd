"""Each Python environment builds DeepSpeed's JIT ops into a folder of its own (no rebuild ping-pong
between virtualenvs sharing torch's default folder); a folder the user chose is kept."""
from __future__ import annotations

import sys

from toolkit.compat import torch_extensions


def test_folder_is_per_environment_and_a_users_choice_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    mine = torch_extensions.install()
    assert mine == str(torch_extensions.extensions_dir()) and "/toolkit/torch_extensions/" in mine
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert torch_extensions.extensions_dir().name.startswith("other-venv-py3")
    assert str(torch_extensions.extensions_dir()) != mine
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    assert torch_extensions.install() == str(tmp_path / "chosen")
