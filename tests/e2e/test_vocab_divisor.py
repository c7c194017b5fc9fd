"""A non-default ``megatron.make_vocab_size_divisible_by`` carried through train, save, the reshard on
resume (a ZeRO checkpoint converted for a megatron run), ``toolkit convert --to megatron`` at another
TP and ``--verify``: every megatron checkpoint written records the run's padded vocabulary, not the
one megatron's default divisor (128) would give."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.runs import resumes, run_in_process, train
from toolkit.checkpoint import reshard
from toolkit.plan import read_plan

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]
DIVISOR = 96
VOCAB, PADDED = 2048, 2112  # the demo's tokens to the next multiple of 96 x tp (192 at tp 2, 96 at tp 1); 128 gives 2048
MEGATRON = ["backend=megatron", "megatron.tp=2", f"megatron.make_vocab_size_divisible_by={DIVISOR}"]


def _record(ckpt) -> dict:
    return json.loads((ckpt / "engine" / "toolkit_megatron.json").read_text())


def _vocab_rows(ckpt) -> dict[str, torch.Tensor]:
    """The stored embedding (and untied output layer) at their global shapes, read with DCP itself."""
    import torch.distributed.checkpoint as dcp
    reader = dcp.FileSystemReader(str(ckpt / "engine"))
    stored = reader.read_metadata().state_dict_metadata
    rows = {k: torch.empty(tuple(stored[k].size)) for k in ("embedding.word_embeddings.weight", "output_layer.weight")
            if k in stored}
    dcp.load(rows, storage_reader=reader, no_dist=True)
    return rows


def _assert_padded(ckpt) -> None:
    """PADDED rows, the padding ones zero (the converter pads with zeros, no gradient reaches them)."""
    assert _record(ckpt)["padded_vocab_size"] == PADDED
    for name, rows in _vocab_rows(ckpt).items():
        assert rows.shape[0] == PADDED, (name, rows.shape)
        assert rows[VOCAB:].abs().max().item() == 0.0, (name, rows[VOCAB:].abs().max().item())


def test_non_default_vocab_divisor_through_resume_and_convert(tmp_path, data_cache, monkeypatch):
    run = tmp_path / "run"
    train(run, data_cache, "train.steps=2", "checkpoint.every=2", "zero.stage=2")
    zero_ckpt = run / "checkpoints" / "step_00000002"

    # resume on megatron: the run reshards the ZeRO checkpoint through the converter, at its own divisor
    train(run, data_cache, "train.steps=4", "checkpoint.every=2", *MEGATRON, "resume=auto")
    assert resumes(run) == [("step_00000002", 2, "converted")]
    saved = run / "checkpoints" / "step_00000004"
    _assert_padded(saved)

    # the resume's conversion itself (the run drops it once loaded), for this run's plan at 2 ranks
    plan_layout = read_plan(run / "plan.json").layout(2)
    monkeypatch.setattr(reshard.dist, "broadcast_object_list", lambda objects, src: None)  # rank 0 alone
    engine = SimpleNamespace(lay=plan_layout, layout_record=plan_layout.record, can_load_layout=lambda saved: False)
    engine_dir, how = reshard.engine_state_dir(zero_ckpt, {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2}, engine,
                                               "megatron", tmp_path / "again", 0, note=lambda line: None)
    assert how == "converted" and plan_layout.padded_vocab == PADDED
    _assert_padded(engine_dir.parent)

    converted = tmp_path / "converted"  # the ZeRO checkpoint written for a megatron run with this divisor
    run_in_process(["convert", str(zero_ckpt), str(converted), "--to", "megatron", "--tp", "2",
                    "--vocab-divisor", str(DIVISOR)])
    _assert_padded(converted)

    # another TP, the divisor taken from the source's record; --verify compares SRC and DST
    tp1 = tmp_path / "tp1"
    run_in_process(["convert", str(saved), str(tp1), "--to", "megatron", "--tp", "1", "--verify"])
    _assert_padded(tp1)
    assert _record(tp1)["make_vocab_size_divisible_by"] == DIVISOR


@pytest.mark.parametrize("to, divisor", [("hf", 64), ("zero", 64), ("megatron", 0)])
def test_vocab_divisor_refused_where_it_means_nothing(to, divisor):
    from toolkit.convert import ConvertError
    from toolkit.convert.run import _asked_layout, _check_request
    with pytest.raises(ConvertError, match=f"--vocab-divisor {divisor}: a positive integer, and for --to megatron"):
        _check_request({}, to, _asked_layout(to, 1, 1, 1, 1, 2, divisor), None, divisor)
