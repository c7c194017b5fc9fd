"""Megatron torch_dist checkpoints resharded by megatron itself (TP 2 -> 1, PP 1 -> 2), and the exact
HF -> Megatron -> HF export. Engine-level, on spawned gloo ranks."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import batches
from tests.helpers.ranks import run_ranks
from toolkit.config import validate
from toolkit.engine import IGNORE_INDEX
from toolkit.families.tiny import tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

FAMILY = "qwen2"  # tied embeddings (shared across pipeline stages), QKV biases, GQA
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _config(tp, pp, vpp=None):
    return validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, "vpp": vpp},
                     "train": {"global_batch_size": 4, "micro_batch_size": 2, "lr": 1e-2, "weight_decay": 0.1}})


def _steps(engine, first, count):
    losses = []
    for step in range(first, first + count):
        micro = batches(250, n_micro=2, mbs=2, seed=100 + step)
        tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
        losses.append(engine.train_step(micro, tokens, lr=1e-2).loss)
    return losses


def _train_and_save(rank, world, tp, pp, path, vpp=None):
    from tests.helpers.ranks import megatron_engine
    model = tiny_model(FAMILY)
    engine = megatron_engine(_config(tp, pp, vpp), model)
    _steps(engine, 0, STEPS_BEFORE)
    engine.save(path, STEPS_BEFORE)
    weights = engine.hf_state()
    return {"weights": weights, "after": _steps(engine, STEPS_BEFORE, STEPS_AFTER)}


def _load_and_continue(rank, world, tp, pp, path, vpp=None):
    from tests.helpers.ranks import megatron_engine
    model = tiny_model(FAMILY, seed=99)  # different init: everything must come from the checkpoint
    engine = megatron_engine(_config(tp, pp, vpp), model)
    engine.load(path)
    weights = engine.hf_state()
    return {"weights": weights, "after": _steps(engine, STEPS_BEFORE, STEPS_AFTER)}


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engine"
    results = run_ranks(_train_and_save, 2, tmp_path_factory.mktemp("save"), 2, 1, path)
    return path, results[0]


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 1)])
def test_reshard_on_load_and_continue(saved_tp2, tmp_path, tp, pp):
    path, saved = saved_tp2
    got = run_ranks(_load_and_continue, tp * pp, tmp_path, tp, pp, path)[0]
    for name, t in saved["weights"].items():
        assert torch.equal(got["weights"][name], t), name
    # the optimizer state (Adam moments, step) came along too: the next steps are the same
    assert got["after"] == pytest.approx(saved["after"], rel=1e-5)
    assert (path / "toolkit_megatron.json").is_file()


def test_interleaved_checkpoint_loads_without_interleaving(tmp_path):
    """Saved with pp=2 x vpp=2 (model0/model1 chunks per rank), loaded at pp=1 and continued."""
    path = tmp_path / "engine"
    saved = run_ranks(_train_and_save, 2, tmp_path, 1, 2, path, 2)[0]
    got = run_ranks(_load_and_continue, 1, tmp_path, 1, 1, path)[0]
    for name, t in saved["weights"].items():
        assert torch.equal(got["weights"][name], t), name
    assert got["after"] == pytest.approx(saved["after"], rel=1e-5)


def _export(rank, world, tp, pp, family, out):
    from tests.helpers.ranks import megatron_engine
    model = tiny_model(family)
    engine = megatron_engine(_config(tp, pp), model)
    engine.export_hf(out, tokenizer=None)
    return model.state_dict() if rank == 0 else None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_to_megatron_to_hf_export_is_exact(tmp_path, family):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "hf"
    original = run_ranks(_export, 4, tmp_path, 2, 2, family, out)[0]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert sorted(loaded) == sorted(original)
    for name, t in original.items():
        assert torch.equal(loaded[name], t), name


def _from_pretrained(rank, world, tp, pp, model_dir):
    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.plan import build_plan
    cfg = validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp},
                    "model": {"name_or_path": str(model_dir), "init": "pretrained"},
                    "train": {"global_batch_size": 4, "micro_batch_size": 2}})
    return MegatronEngine(build_plan(cfg, [world])).hf_state()


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_pretrained_safetensors_load_lazily_and_exactly(tmp_path, family):
    """model.init=pretrained: ranks read the safetensors tensors they need (tied lm_head absent)."""
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    got = run_ranks(_from_pretrained, 2, tmp_path, 2, 1, tmp_path / "hf")[0]  # TP slices from safetensors
    for name, t in model.state_dict().items():
        assert torch.equal(got[name], t), name
