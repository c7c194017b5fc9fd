"""A torchtitan checkpoint written by 2 ranks (each tensor a DTensor sharded on dim 0, as FSDP2 holds
it): its weights and Adam moments come back whole, in HF's names and layout."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.torchtitan import save_titan_sharded
from toolkit.formats.detect import open_source

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")


def test_two_writer_ranks_read_back_whole(tmp_path):
    reference = run_ranks(save_titan_sharded, 2, tmp_path, str(tmp_path))[0]
    ckpt = tmp_path / "step-2"
    assert len(list(ckpt.glob("*.distcp"))) == 2
    from toolkit.families.tiny import tiny_config
    tiny_config("llama").to_json_file(tmp_path / "config.json")
    source = open_source(ckpt, str(tmp_path / "config.json"))
    try:
        assert (source.format, source.layout, source.step) == ("torchtitan", {"dp": 2}, 2)
        assert sorted(source.names()) == sorted(reference["model"])
        for name in source.names():
            assert torch.equal(source.read(name), reference["model"][name]), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(source.read(name, key), reference["moments"][name][key]), (name, key)
    finally:
        source.close()
