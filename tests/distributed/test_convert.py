"""Checkpoint converter against references we did not write: DeepSpeed's zero_to_fp32 and its own
load_checkpoint, transformers' from_pretrained, megatron-core's dist_checkpointing.load.

ZeRO checkpoints of every family are written once per session by DeepSpeed itself (spawned gloo
ranks at DP 1, 2, 3; stages 1-3); the hops between formats are then pure in-process tensor tests.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.convert import (
    FAMILIES,
    FROZEN,
    MOE_FAMILIES,
    PREBUILT,
    STAGES,
    build_zero_checkpoints,
    load_universal,
    megatron_load,
    megatron_load_families,
    optimizer_state_by_engines,
    save_legacy_megatron,
)
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import run_cli, run_in_process
from toolkit.convert import ConvertError, convert, open_source
from toolkit.families import find_family, unpack
from toolkit.formats.canonical import hf_config_object

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]
DPS = (1, 2, 3)  # 3 is odd: flat partitions get padding
FULL = os.environ.get("TOOLKIT_CONVERT_FULL_MATRIX") == "1"
"""Every family x stage x DP (48 DeepSpeed runs, ~5 min on 2 busy cores); by default every family
at DP 3 (odd: padding) at ZeRO-2 and 3, plus llama, qwen2 and the frozen model at every stage and DP.
ZeRO-1 and ZeRO-2 write one format (DeepSpeed's stage_1_and_2 optimizer: the same flat fp32
partitions; stage 1 only leaves frozen parameters out, which the frozen model checks), so ZeRO-1 of
every other family would repeat ZeRO-2's reads. Mixture-of-experts families are saved by
transformers 5 as packed expert parameters, read back one expert tensor at a time."""
MATRIX = [(f, s, d) for f in FAMILIES + MOE_FAMILIES + (FROZEN,) for s in STAGES for d in DPS
          if FULL or f in ("llama", "qwen2") or (d == 3 and (s != 1 or f == FROZEN))]


@pytest.fixture(scope="session")
def zero_ckpts(request, tmp_path_factory) -> Path:
    if PREBUILT:
        return Path(PREBUILT)
    return build_zero_checkpoints(tmp_path_factory, "zero_ckpts", selected_cells(request))


def selected_cells(request) -> list[tuple[str, int, int]]:
    """The MATRIX cells of the families the selected tests name (``-k olmo2`` saves olmo2's only);
    all of MATRIX when a selected test using the checkpoints names no family."""
    families = set()
    for item in request.session.items:
        if "zero_ckpts" not in item.fixturenames:
            continue
        family = getattr(item, "callspec", None) and item.callspec.params.get("family")
        if family is None:
            return MATRIX
        families.add(family)
    return [cell for cell in MATRIX if cell[0] in families]


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
    ref = unpack(find_family(src.model_type), hf_config_object(src.hf_config), ref)  # MoE: a tensor per expert
    if family == FROZEN:
        frozen = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"}
        assert src.frozen == frozen and not src.read("model.embed_tokens.weight", "exp_avg").any()  # no moments
        if stage == 1:  # zero_to_fp32 drops them (DeepSpeed records frozen params from stage 2 on only);
            module = torch.load(ckpt / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
            ref.update({n: module[n] for n in frozen})  # they live in the module state dict stage 1 saves
    for name in src.names():
        assert torch.equal(src.read(name), ref[name].float()), name
    if src.tied:  # DeepSpeed lists the tied head as a shared param; the stream drops it
        assert "lm_head.weight" not in src.names() and torch.equal(ref["lm_head.weight"], ref[
            next(n for n in src.names() if "embed_tokens" in n or "wte" in n)])
    else:
        assert set(ref) == set(src.names())


MEGATRON_LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))


def megatron_layouts(family: str, stage: int, dp: int) -> tuple:
    """Two TP x PP layouts from each family's ZeRO-3 DP-3 checkpoint, alternating over the families so
    every layout meets half of them (TP 1 and 2 both, PP 1 and 2 both); one layout, in turn, from its
    other checkpoints (all four everywhere with the full matrix). The Megatron writer sees only the
    canonical stream, which ``test_zero_reader_equals_zero_to_fp32`` pins for every stage and DP, so
    more hops would repeat the same writes."""
    if FULL:
        return MEGATRON_LAYOUTS
    if (stage, dp) == (3, 3):
        order = sorted({f for f, _, _ in MATRIX})
        return MEGATRON_LAYOUTS[0::3] if order.index(family) % 2 == 0 else MEGATRON_LAYOUTS[1:3]
    return (MEGATRON_LAYOUTS[(stage + dp) % 4],)


@pytest.mark.parametrize("family,stage,dp", MATRIX)
def test_matrix_zero_megatron_hf_zero_exact(zero_ckpts, tmp_path, monkeypatch, family, stage, dp):
    """ZeRO -> Megatron at TP {1,2} x PP {1,2} -> HF -> ZeRO: exact tensors at every hop; Adam
    moments and step carried through Megatron and back to ZeRO. Vocab matrices are written in
    small row blocks (as large models' are), the last one partly vocab padding."""
    monkeypatch.setattr("toolkit.formats.megatron.ROW_BLOCK_BYTES", 4096)
    zero = open_source(zero_ckpts / f"{family}-z{stage}-dp{dp}")
    for tp, pp in megatron_layouts(family, stage, dp):
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

    from toolkit.families.tiny import tiny_model
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


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_megatron_core_loads_converted_checkpoint(zero_ckpts, tmp_path, monkeypatch, tp, pp):
    """megatron-core's dist_checkpointing.load of our torch_dist output (converted from ZeRO-3;
    tied and untied embeddings, QKV biases, learned positions, vocab in row blocks) at TP/PP 1 and 2
    gives exactly the source weights, for every dense family (one job per layout loads them in turn)."""
    monkeypatch.setattr("toolkit.formats.megatron.ROW_BLOCK_BYTES", 4096)
    sources = {f: open_source(zero_ckpts / f"{f}-z3-dp3") for f in FAMILIES}
    for family, src in sources.items():
        convert(src.path, tmp_path / family, to="megatron", tp=tp, pp=pp)
    ckpts = {f: str(tmp_path / f / "engine") for f in FAMILIES}
    loaded = run_ranks(megatron_load_families, tp * pp, tmp_path, tp, pp, ckpts)[0]
    for family, src in sources.items():
        _loaded_exactly(loaded[family], src)


def _loaded_exactly(weights: dict, src) -> None:
    if src.tied:
        assert torch.equal(weights.pop("lm_head.weight"), weights[next(n for n in src.names() if "embed_tokens" in n
                                                                       or "wte" in n)])
    assert sorted(weights) == sorted(src.names()), src.path
    for name in src.names():
        assert torch.equal(weights[name], src.read(name)), (src.path, name)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_megatron_core_loads_converted_moe_checkpoint_at_ep2(zero_ckpts, tmp_path, family):
    """A ZeRO-3 MoE checkpoint (packed experts; qwen2_moe: gated shared expert, tied embeddings)
    converted for EP=2 and loaded by megatron-core on 2 ranks, each holding 2 of the 4 experts: exact weights."""
    src = open_source(zero_ckpts / f"{family}-z3-dp3")
    _refused(src.path, tmp_path / "meg", "choose dp a multiple of 2", to="megatron", ep=2, dp=3)
    convert(src.path, tmp_path / "meg", to="megatron", ep=2)  # dp defaults to ep
    ranks = run_ranks(megatron_load, 2, tmp_path, family, 1, 1, str(tmp_path / "meg" / "engine"), 2)
    _loaded_exactly(ranks[0]["weights"], src)


def test_optimizer_state_both_ways_as_deepspeed_and_megatron_load_it(zero_ckpts, tmp_path):
    """Moments judged by loaders we did not write, one path each way. ZeRO -> Megatron: what
    megatron-core's load puts into its distributed optimizer equals what DeepSpeed's own
    load_checkpoint reads from the source as DeepSpeed saved it. Megatron -> ZeRO: DeepSpeed's load
    of our ZeRO conversion of that Megatron output equals megatron-core's view of it. (The toolkit's
    readers play no part.) And --weights-only outputs load in both with the source's weights, zero
    moments and step 0."""
    src = zero_ckpts / "qwen2-z2-dp1"
    convert(src, tmp_path / "meg", to="megatron")
    convert(tmp_path / "meg", tmp_path / "zero", to="zero", dp=1, zero_stage=2)
    for to, args in (("zero", {"dp": 1, "zero_stage": 2}), ("megatron", {})):
        summary = convert(src, tmp_path / f"{to}_weights_only", to=to, weights_only=True, **args)
        assert summary["optimizer_state"] is False
    ckpts = {"zero_src": src, "meg": tmp_path / "meg" / "engine", "zero_out": tmp_path / "zero" / "engine",
             "zero_weights_only": tmp_path / "zero_weights_only" / "engine",
             "meg_weights_only": tmp_path / "megatron_weights_only" / "engine"}
    views = run_ranks(optimizer_state_by_engines, 1, tmp_path, "qwen2", {k: str(v) for k, v in ckpts.items()})[0]
    deepspeed_src = views["zero_src"]["tensors"]
    assert views["zero_src"]["steps"] == views["zero_out"]["steps"] == {"<class 'int'>2"}
    assert views["meg"]["steps"] == {2.0}
    assert all(t["exp_avg"].abs().max() > 0 for t in deepspeed_src.values())  # trained: real moments
    megatron = views["meg"]["tensors"]
    assert set(megatron) - {"lm_head.weight"} == set(deepspeed_src)  # DeepSpeed lists the tied head once
    for name, want in deepspeed_src.items():
        for state, tensor in want.items():
            assert torch.equal(megatron[name][state], tensor), ("zero -> megatron", name, state)
            assert torch.equal(views["zero_out"]["tensors"][name][state], tensor), ("megatron -> zero", name, state)
    assert views["zero_weights_only"]["steps"] == {"<class 'int'>0"} and views["meg_weights_only"]["steps"] == {0.0}
    for view in ("zero_weights_only", "meg_weights_only"):
        for name, want in deepspeed_src.items():
            got = views[view]["tensors"][name]
            assert torch.equal(got["param"], want["param"]), (view, name)
            assert not got["exp_avg"].any() and not got["exp_avg_sq"].any(), (view, name)


# --- refusals: each with its own message, DST never created -----------------------------------------------

def _refused(src, dst, match, **kw):
    with pytest.raises(ConvertError, match=match):
        convert(src, dst, **kw)
    assert not Path(dst).exists() and not list(Path(dst).parent.glob(f".staging-{Path(dst).name}*"))


def test_unknown_format_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.npz").write_bytes(b"nothing")
    _refused(tmp_path / "src", tmp_path / "dst", "unknown checkpoint format")


def test_missing_and_truncated_files_refused(zero_ckpts, tmp_path):
    src = tmp_path / "z"
    shutil.copytree(zero_ckpts / "llama-z2-dp3", src)
    tag = src / "global_step2"
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(tmp_path / "kept.pt")
    _refused(src, tmp_path / "dst", r"DP rank\(s\) \[1\] are missing")
    data = (tmp_path / "kept.pt").read_bytes()
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(data[: len(data) // 2])
    _refused(src, tmp_path / "dst", "truncated")
    convert(zero_ckpts / "llama-z2-dp3", tmp_path / "hf", to="hf", max_shard_bytes=64 << 10)
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    shards[1].unlink()
    _refused(tmp_path / "hf", tmp_path / "dst", "does not match its manifest: model-00002-of-.*: missing")
    (tmp_path / "hf" / "manifest.json").unlink()  # an HF export as users have it: the index must catch it
    _refused(tmp_path / "hf", tmp_path / "dst", r"shard\(s\) .* are missing")


def test_truncated_safetensors_refused(zero_ckpts, tmp_path):
    convert(zero_ckpts / "llama-z1-dp3", tmp_path / "hf", to="hf")
    f = tmp_path / "hf" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    (tmp_path / "hf" / "manifest.json").unlink()  # without a manifest the size check must catch it
    _refused(tmp_path / "hf", tmp_path / "dst", "truncated", to="zero")


def test_bit_flip_caught_by_manifest(zero_ckpts, tmp_path):
    convert(zero_ckpts / "llama-z3-dp3", tmp_path / "meg", to="megatron")
    f = next((tmp_path / "meg" / "engine").glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    _refused(tmp_path / "meg", tmp_path / "dst", "sha256 differs")


def test_wrong_family_refused(zero_ckpts, tmp_path):
    convert(zero_ckpts / "llama-z3-dp3", tmp_path / "meg", to="megatron")
    cfg = tmp_path / "gpt2.json"
    cfg.write_text((zero_ckpts / "gpt2-z3-dp3" / "config.json").read_text())
    _refused(tmp_path / "meg", tmp_path / "dst", "written for family 'llama'", hf_config=str(cfg))
    (tmp_path / "meg" / "engine" / "toolkit_megatron.json").unlink()  # a bare megatron checkpoint
    (tmp_path / "meg" / "manifest.json").unlink()
    _refused(tmp_path / "meg", tmp_path / "dst", "do not match the gpt2 family table", hf_config=str(cfg))
    _refused(zero_ckpts / "llama-z3-dp3", tmp_path / "dst", "do not match the gpt2 family table",
             to="megatron", hf_config=str(cfg))


def test_foreign_pickle_class_refused(zero_ckpts, tmp_path):
    import argparse
    src = tmp_path / "z"
    shutil.copytree(zero_ckpts / "llama-z2-dp2", src)
    model_file = src / "global_step2" / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "parser": argparse.ArgumentParser}, model_file)  # not a checkpoint class
    _refused(src, tmp_path / "dst", r"refusing to unpickle argparse\.ArgumentParser.*TOOLKIT_TRUST_PICKLE_CLASSES")


def test_existing_dst_untouched_and_interrupted_conversion_leaves_no_dst(zero_ckpts, tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "mine.txt").write_text("keep")
    with pytest.raises(ConvertError, match="already exists"):
        convert(zero_ckpts / "llama-z2-dp2", dst, to="hf")
    assert [p.name for p in dst.iterdir()] == ["mine.txt"]
    from toolkit.formats import hf

    def crash(*a, **k):
        raise KeyboardInterrupt  # an interrupt half-way through the writes
    monkeypatch.setattr(hf, "_write_shard", crash)
    with pytest.raises(KeyboardInterrupt):
        convert(zero_ckpts / "llama-z2-dp2", tmp_path / "dst2", to="hf")
    assert not (tmp_path / "dst2").exists() and not list(tmp_path.glob(".staging-*"))


def test_cli_convert_verify_and_inspect(zero_ckpts, tmp_path):
    ckpt = zero_ckpts / "qwen2-z2-dp2"
    info = json.loads(run_in_process(["inspect", str(ckpt), "--json"]).stdout)
    assert (info["format"], info["family"], info["layout"]["dp"], info["layout"]["zero_stage"], info["step"],
            info["optimizer_state"]) == ("zero", "qwen2", 2, 2, 2, True)
    out = run_cli(["convert", str(ckpt), str(tmp_path / "meg"), "--to", "megatron", "--tp", "2", "--pp", "2",
                   "--verify"]).stdout
    assert "verify: OK" in out and "0 differ" in out
    out = run_in_process(["convert", str(tmp_path / "meg"), str(tmp_path / "hf"), "--dtype", "bf16", "--verify"]).stdout
    assert "verify: OK" in out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    bad = run_in_process(["convert", str(ckpt), str(tmp_path / "x"), "--to", "megatron", "--tp", "3"], check=False)
    assert bad.returncode == 2 and "choose tp in [1, 2]" in bad.stderr and not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def qwen2_megatron(zero_ckpts, tmp_path_factory) -> Path:
    """qwen2 (ZeRO-2, DP 2) as a Megatron checkpoint: a source that --to hf writes through the torch path."""
    out = tmp_path_factory.mktemp("qwen2_megatron") / "meg"
    convert(zero_ckpts / "qwen2-z2-dp2", out, to="megatron")
    return out


def _verify_cli(src: Path, dst: Path, *args: str):
    proc = run_in_process(["convert", str(src), str(dst), "--verify", *args], check=False)
    logits = re.search(r"logits: max \|diff\| (\S+) \(allowed (\S+)\)", proc.stdout)
    return proc, (float(logits[1]), float(logits[2])) if logits else None


def test_verify_exits_1_when_dst_holds_a_wrong_tensor(qwen2_megatron, tmp_path, monkeypatch):
    """A writer bug (one element of one tensor written as 0): --verify names it and exits 1."""
    from toolkit.formats import hf
    correct = hf._tensor_writer

    def zeroes_the_last_element_of_the_norm(source, dtype):
        write = correct(source, dtype)

        def buggy(f, name):
            nbytes = write(f, name)
            if name == "model.norm.weight":
                f.seek(-4, os.SEEK_CUR)
                f.write(bytes(4))
            return nbytes
        return buggy
    monkeypatch.setattr(hf, "_tensor_writer", zeroes_the_last_element_of_the_norm)
    proc, _ = _verify_cli(qwen2_megatron, tmp_path / "hf")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 differ (model.norm.weight)" in proc.stdout and "verify: MISMATCH" in proc.stdout


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_verify_judges_the_logits_of_dst_as_stored(qwen2_megatron, tmp_path, monkeypatch, dtype):
    """The logits check compares SRC's forward at full precision with DST's as stored: exact in fp32,
    a nonzero rounding effect within the dtype's bound in bf16/fp16 (comparing rounded weights again
    would report 0). A DST whose tensors are all right but whose config.json is wrong (a writer bug:
    rms_norm_eps 1e-6 -> 1e-2) fails on the logits alone, with exit 1."""
    from toolkit.formats import hf
    proc, (diff, allowed) = _verify_cli(qwen2_megatron, tmp_path / "good", "--dtype", dtype)
    assert proc.returncode == 0 and "0 differ" in proc.stdout, proc.stdout + proc.stderr
    print(f"\n{dtype}: logits max |diff| {diff:.3g}, allowed {allowed:.3g}")
    if dtype == "fp32":
        assert diff == 0
    else:  # measured 1.9e-3 (bf16) and 1.7e-4 (fp16) of max |logit| ~1
        assert 0 < diff <= allowed, f"logits max |diff| {diff} (allowed {allowed})"
    correct = hf.write_hf_files

    def wrong_norm_eps(out, slots, write, config, *args, **kw):
        return correct(out, slots, write, {**config, "rms_norm_eps": 1e-2}, *args, **kw)
    monkeypatch.setattr(hf, "write_hf_files", wrong_norm_eps)
    proc, (diff, allowed) = _verify_cli(qwen2_megatron, tmp_path / "bad", "--dtype", dtype)
    assert proc.returncode == 1 and "0 differ" in proc.stdout and "verify: MISMATCH" in proc.stdout
    assert diff > allowed


def test_plain_deepspeed_checkpoint_without_config_needs_hf_config(zero_ckpts, tmp_path):
    """A bare DeepSpeed save_checkpoint folder (no config.json beside it): refused until --hf-config."""
    src = tmp_path / "bare"
    shutil.copytree(zero_ckpts / "gpt2-z2-dp3", src)
    (tmp_path / "model").mkdir()
    (src / "config.json").rename(tmp_path / "model" / "config.json")
    _refused(src, tmp_path / "dst", "pass --hf-config")
    convert(src, tmp_path / "hf", to="hf", hf_config=str(tmp_path / "model"))
    _equal_sources(open_source(zero_ckpts / "gpt2-z2-dp3"), open_source(tmp_path / "hf"))


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_legacy_megatron_mp_rank_files_read(tmp_path, tp, pp):
    """Megatron-LM's legacy per-rank layout (TP slices, stage-local layer numbers) read back to
    exactly the weights the megatron-core model held; then converted to HF."""
    from tests.helpers.convert import write_config
    root = tmp_path / "legacy"
    held = run_ranks(save_legacy_megatron, tp * pp, tmp_path, "qwen2", tp, pp, str(root))[0]["weights"]
    write_config(root, "qwen2")
    src = open_source(root)
    assert (src.format, src.layout, src.step) == ("megatron-legacy", {"tp": tp, "pp": pp}, 3)
    for name in src.names():
        assert torch.equal(src.read(name), held[name]), name
    convert(root, tmp_path / "hf", to="hf")
    _equal_sources(src, open_source(tmp_path / "hf"))
