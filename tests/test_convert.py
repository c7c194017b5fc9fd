"""Checkpoint converter against references we did not write: DeepSpeed's zero_to_fp32 and its own
load_checkpoint, transformers' from_pretrained, megatron-core's dist_checkpointing.load.

ZeRO checkpoints of every family are written once per session by DeepSpeed itself (spawned gloo
ranks at DP 1, 2, 3; stages 1-3); the hops between formats are then pure in-process tensor tests.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.convert_helpers import FAMILIES, STAGES, load_universal, save_zero_checkpoints
from tests.test_megatron_compat import run_ranks
from toolkit.convert import ConvertError, convert, open_source

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")
DPS = (1, 2, 3)  # 3 is odd: flat partitions get padding
FULL = os.environ.get("TOOLKIT_CONVERT_FULL_MATRIX") == "1"
"""Every family x stage x DP (36 DeepSpeed runs, ~4 min on 2 busy cores); by default every family
and stage at DP 3 (odd: padding) plus llama and qwen2 at DP 1 and 2 (~2 min)."""
MATRIX = [(f, s, d) for f in FAMILIES for s in STAGES for d in DPS
          if FULL or d == 3 or f in ("llama", "qwen2")]
PREBUILT = os.environ.get("TOOLKIT_CONVERT_CKPTS")
"""Development shortcut: a directory a previous session's fixture wrote (tests then skip DeepSpeed)."""


@pytest.fixture(scope="session")
def zero_ckpts(tmp_path_factory) -> Path:
    if PREBUILT:
        return Path(PREBUILT)
    root = tmp_path_factory.mktemp("zero_ckpts")
    for dp in DPS:
        combos = [(f, s) for f, s, d in MATRIX if d == dp]
        run_ranks(save_zero_checkpoints, dp, tmp_path_factory.mktemp(f"ranks{dp}"), str(root), combos, timeout=900)
    return root


def _equal_sources(a, b, states=("param",)) -> None:
    assert a.names() == b.names() or sorted(a.names()) == sorted(b.names())
    for name in a.names():
        for state in states:
            x, y = a.read(name, state), b.read(name, state)
            assert x.shape == y.shape and torch.equal(x, y), f"{name} {state}"


@pytest.mark.parametrize("family,stage,dp", MATRIX)
def test_zero_reader_equals_zero_to_fp32(zero_ckpts, family, stage, dp):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    ckpt = zero_ckpts / f"{family}-z{stage}-dp{dp}"
    src = open_source(ckpt)
    assert (src.format, src.layout["dp"], src.layout["zero_stage"], src.step) == ("zero", dp, stage, 2)
    ref = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    for name in src.names():
        assert torch.equal(src.read(name), ref[name].float()), name
    if src.tied:  # DeepSpeed lists the tied head as a shared param; the stream drops it
        assert "lm_head.weight" not in src.names() and torch.equal(ref["lm_head.weight"], ref[
            next(n for n in src.names() if "embed_tokens" in n or "wte" in n)])
    else:
        assert set(ref) == set(src.names())


@pytest.mark.parametrize("family,stage,dp", MATRIX)
def test_matrix_zero_megatron_hf_zero_exact(zero_ckpts, tmp_path, family, stage, dp):
    """ZeRO -> Megatron at TP {1,2} x PP {1,2} -> HF -> ZeRO: exact tensors at every hop; Adam
    moments and step carried through Megatron and back to ZeRO."""
    zero = open_source(zero_ckpts / f"{family}-z{stage}-dp{dp}")
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        meg = tmp_path / f"meg-tp{tp}-pp{pp}"
        convert(zero.path, meg, to="megatron", tp=tp, pp=pp)
        m = open_source(meg)
        assert m.step == 2 and m.has_optimizer
        _equal_sources(zero, m, ("param", "exp_avg", "exp_avg_sq"))
    convert(meg, tmp_path / "hf", to="hf")
    hf = open_source(tmp_path / "hf")
    _equal_sources(zero, hf)
    convert(tmp_path / "hf", tmp_path / "zero_from_hf", to="zero", dp=2, zero_stage=3)
    _equal_sources(zero, open_source(tmp_path / "zero_from_hf"))
    convert(meg, tmp_path / "zero_from_meg", to="zero", dp=3, zero_stage=1)
    back = open_source(tmp_path / "zero_from_meg")
    assert back.step == 2 and back.has_optimizer
    _equal_sources(zero, back, ("param", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])  # tied embeddings, Conv1D weights
def test_hf_output_loads_with_transformers_same_logits(zero_ckpts, tmp_path, family):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from tests.test_families import tiny_model
    ckpt = zero_ckpts / f"{family}-z3-dp3"
    convert(ckpt, tmp_path / "hf", to="hf", max_shard_bytes=64 << 10)  # several shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ref = tiny_model(family, seed=5)
    ref.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt)), strict=True)
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)


def test_deepspeed_load_checkpoint_resumes_universal_output_exactly(zero_ckpts, tmp_path):
    """Our ZeRO output, loaded by DeepSpeed's own load_checkpoint at other DP sizes and stages,
    holds exactly the source's fp32 weights, Adam moments and step (and trains on)."""
    src = open_source(zero_ckpts / "qwen2-z3-dp2")
    convert(src.path, tmp_path / "uni", to="zero", dp=2, zero_stage=2)
    for world, stage in ((1, 3), (2, 2), (3, 1)):
        res = run_ranks(load_universal, world, tmp_path, "qwen2", stage, str(tmp_path / "uni" / "engine"))
        loaded = res[0]["tensors"]
        assert set(loaded) == set(src.names()) and res[0]["steps"] == {"<class 'int'>2"}
        for name in src.names():
            for state in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded[name][state], src.read(name, state)), (world, stage, name, state)
