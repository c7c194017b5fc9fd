"""The direct ZeRO -> HF route (toolkit/formats/direct.py): byte for byte the torch path's output,
no torch import, and the torch path whenever the direct route does not apply.

ZeRO checkpoints are written by DeepSpeed itself (spawned gloo ranks, as in test_convert.py), a
few: qwen2 (tied embeddings) at stages 1-3 at DP 1 and 3 (odd: padding), and llama with frozen
parameters (untied; frozen fragments in the model-states files) at stages 1-3 at DP 3.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.convert import FROZEN, PREBUILT, build_zero_checkpoints
from toolkit.convert import ConvertError, convert
from toolkit.formats.detect import locate
from toolkit.formats.direct import NotDirect, open_direct

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]
CASES = [("qwen2", s, d) for d in (1, 3) for s in (1, 2, 3)] + [(FROZEN, s, 3) for s in (1, 2, 3)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def direct_ckpts(tmp_path_factory) -> Path:
    if PREBUILT:  # TOOLKIT_CONVERT_CKPTS: test_convert.py's full set holds these too
        return Path(PREBUILT)
    return build_zero_checkpoints(tmp_path_factory, "direct_ckpts", CASES)


def _torch_path(monkeypatch) -> None:
    monkeypatch.setattr("toolkit.formats.direct.open_direct", lambda found: None)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family,stage,dp", CASES)
def test_direct_output_is_the_torch_paths_byte_for_byte(direct_ckpts, tmp_path, monkeypatch, family, stage, dp):
    ckpt = direct_ckpts / f"{family}-z{stage}-dp{dp}"
    assert open_direct(locate(ckpt)) is not None  # the direct route applies here
    for shard in (5 << 30, 64 << 10):  # one file; several shards + index
        convert(ckpt, tmp_path / f"direct-{shard}", to="hf", max_shard_bytes=shard)
        with monkeypatch.context() as m:
            _torch_path(m)
            convert(ckpt, tmp_path / f"torch-{shard}", to="hf", max_shard_bytes=shard)
        direct, reference = _files(tmp_path / f"direct-{shard}"), _files(tmp_path / f"torch-{shard}")
        assert list(direct) == list(reference)
        assert "manifest.json" in direct and "COMPLETE" in direct
        assert (shard == 64 << 10) == ("model.safetensors.index.json" in direct)
        for name in reference:
            assert direct[name] == reference[name], name


def test_cli_direct_route_imports_no_torch(direct_ckpts, tmp_path):
    """``toolkit convert CKPT OUT --to hf`` as a user runs it: torch, transformers, DeepSpeed and
    numpy are never imported; the output verifies against its manifest."""
    ckpt, dst = direct_ckpts / "qwen2-z3-dp3", tmp_path / "hf"
    code = ("import sys; from toolkit.cli import main; rc = main(sys.argv[1:]); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'deepspeed', 'numpy', 'safetensors')); "
            "print('HEAVY', heavy); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "convert", str(ckpt), str(dst), "--to", "hf"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout and "converted zero -> hf" in proc.stdout, proc.stdout
    assert "torch-free reader" in proc.stdout
    from toolkit.storage import verify_complete
    assert verify_complete(dst) == []


def test_foreign_pickle_class_refused_as_before(direct_ckpts, tmp_path):
    """A class outside the allowlist: the direct route steps aside and safeload refuses, naming it."""
    import argparse
    src = tmp_path / "z"
    shutil.copytree(direct_ckpts / "qwen2-z2-dp3", src)
    torch.save({"module": {}, "parser": argparse.ArgumentParser}, src / "global_step2" / "mp_rank_00_model_states.pt")
    assert open_direct(locate(src)) is None
    with pytest.raises(ConvertError, match=r"refusing to unpickle argparse\.ArgumentParser.*TOOLKIT_TRUST_PICKLE"):
        convert(src, tmp_path / "dst", to="hf")
    assert not (tmp_path / "dst").exists()


def test_dtype_and_missing_tie_flag_take_the_torch_path(direct_ckpts, tmp_path):
    """--dtype bf16 casts on the torch path, to the direct output's values; a config.json without
    tie_word_embeddings is read by the torch path too (the class default needs transformers)."""
    from safetensors import safe_open
    ckpt = direct_ckpts / "qwen2-z3-dp3"
    convert(ckpt, tmp_path / "fp32", to="hf")
    assert convert(ckpt, tmp_path / "bf16", to="hf", dtype="bf16")["reader"] == "torch"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    fp32 = safe_open(str(tmp_path / "fp32" / "model.safetensors"), "pt")
    bf16 = safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt")
    assert list(fp32.keys()) == list(bf16.keys())
    for name in fp32.keys():
        assert torch.equal(fp32.get_tensor(name).to(torch.bfloat16), bf16.get_tensor(name)), name
    src = tmp_path / "untold"
    shutil.copytree(ckpt, src)
    config = json.loads((src / "config.json").read_text())
    assert config.pop("tie_word_embeddings") is True  # qwen2's class default is untied: the flag matters
    (src / "config.json").write_text(json.dumps(config))
    assert open_direct(locate(src)) is None
    convert(src, tmp_path / "untold_hf", to="hf")  # transformers' Qwen2Config default: untied, lm_head kept
    untold = safe_open(str(tmp_path / "untold_hf" / "model.safetensors"), "pt")
    assert torch.equal(untold.get_tensor("lm_head.weight"), fp32.get_tensor("model.embed_tokens.weight"))


def test_only_mixture_of_experts_families_pack_and_their_configs_say_so():
    """The direct route cannot unpack packed experts (the family table needs torch); it recognises
    them by the config naming experts. Every family that packs must be recognised, and no other."""
    from toolkit.families import find_family
    from toolkit.families.tiny import TINY, TINY_MOE, tiny_config
    from toolkit.formats.direct import _check_no_packed_experts
    for family in sorted({**TINY, **TINY_MOE}):
        config = tiny_config(family).to_dict()
        if find_family(family).packed:
            with pytest.raises(NotDirect):
                _check_no_packed_experts(config)
        else:
            _check_no_packed_experts(config)
