"""An export directory (``hf_final/``, ``adapter/``) is built beside its place and replaces it whole:
the one helper the HF and the PEFT writers share (``adapters/export._replaced_whole``).

Bugs these catch: a re-export (a resumed run that had finished) failing on the directory it
replaces or mixing old files into the new one, and a failed build that has already removed the
export it was replacing."""
from __future__ import annotations

import pytest

from toolkit.adapters.export import _replaced_whole


def test_a_finished_build_replaces_the_old_directory_whole(tmp_path):
    path = tmp_path / "hf_final"
    path.mkdir()
    (path / "stale.bin").write_text("old")
    with _replaced_whole(path) as stage:
        assert stage.parent == tmp_path and stage != path and not any(stage.iterdir())
        (stage / "model.safetensors").write_text("new")
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_final"]  # no staging directory left


def test_a_failed_build_leaves_the_old_export(tmp_path):
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_model.safetensors").write_text("old")
    with pytest.raises(OSError, match="disk full"):
        with _replaced_whole(path) as stage:
            (stage / "adapter_model.safetensors").write_text("half")
            raise OSError("disk full")
    assert (path / "adapter_model.safetensors").read_text() == "old"
