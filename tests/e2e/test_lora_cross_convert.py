"""LoRA checkpoints across backends (``toolkit/lora/checkpoint.py``), end to end through the CLI:
a ZeRO-2 LoRA checkpoint converted ``--to megatron --tp 2`` and a megatron TP=2 one converted
``--to zero`` resume with ``--resume auto`` on the other backend and continue the loss curve of
the uninterrupted run (adapters, Adam moments and step carried); a round trip keeps every tensor
and moment bit for bit; a megatron LoRA checkpoint converts ``--to peft`` / ``--to hf`` equal to
its run's own ``adapter/`` and ``hf_final/``.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.lora import LORA_RUN
from tests.helpers.runs import losses, resumes, run_in_process, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]
TP2 = ["backend=megatron", "megatron.tp=2"]
K = 3  # checkpoint.every=3 of 6 steps
LOSS_RTOL = 1e-6
"""Resumed steps vs the uninterrupted run on the other backend: the backends' LoRA losses agree to
4.7e-8 relative over whole runs (tests/e2e/test_megatron_lora.py); measured here <= 1e-7."""


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, data_cache, demo_base):
    root = tmp_path_factory.mktemp("lora_cross")
    out = {}
    for name, overrides in (("zero2", ["zero.stage=2"]), ("tp2", TP2)):
        out[name] = root / name
        train(out[name], data_cache, *LORA_RUN, f"model.name_or_path={demo_base}", *overrides)
    return out


def _convert_and_resume(tmp_path, data_cache, demo_base, run, to_args, target):
    ckpt = run / "checkpoints" / f"step_{K:08d}"
    resumed = tmp_path / "resumed"
    proc = run_in_process(["convert", str(ckpt), str(resumed / "checkpoints" / f"step_{K:08d}"), *to_args, "--verify"])
    assert "optimizer moments: " in proc.stdout and "verify: OK" in proc.stdout, proc.stdout[-2000:]
    train(resumed, data_cache, *LORA_RUN, f"model.name_or_path={demo_base}", *target, "resume=auto")
    assert [r[:2] for r in resumes(resumed)] == [(f"step_{K:08d}", K)]
    return losses(run), losses(resumed)


def _assert_continues(full, resumed, label):
    gap = max(abs(a - b) / b for a, b in zip(resumed, full[K:]))
    print(f"\n{label}: resumed steps {K + 1}-{len(full)} vs the uninterrupted run: max relative gap {gap:.1e}")
    assert len(full) == 6 and len(resumed) == 3
    assert resumed == pytest.approx(full[K:], rel=LOSS_RTOL)


def test_zero_lora_checkpoint_resumes_on_megatron_tp2(lora_runs, tmp_path, data_cache, demo_base):
    full, resumed = _convert_and_resume(tmp_path, data_cache, demo_base, lora_runs["zero2"],
                                        ["--to", "megatron", "--tp", "2"], TP2)
    _assert_continues(full, resumed, "ZeRO-2 -> megatron TP2")


def test_megatron_lora_checkpoint_resumes_on_zero3_dp2(lora_runs, tmp_path, data_cache, demo_base):
    full, resumed = _convert_and_resume(tmp_path, data_cache, demo_base, lora_runs["tp2"],
                                        ["--to", "zero", "--dp", "2", "--zero-stage", "3"], ["zero.stage=3"])
    _assert_continues(full, resumed, "megatron TP2 -> ZeRO-3 DP2")


def test_round_trip_keeps_adapters_and_moments_bit_for_bit_and_back_to_peft_exact(lora_runs, tmp_path):
    from toolkit.convert import convert
    from toolkit.formats.lora_checkpoint import lora_checkpoint_meta
    from toolkit.lora.checkpoint import read_lora_checkpoint
    ckpt = lora_runs["zero2"] / "checkpoints" / f"step_{K:08d}"
    convert(ckpt, tmp_path / "m", to="megatron", tp=2)
    convert(tmp_path / "m", tmp_path / "z", to="zero", dp=2, zero_stage=1)
    sources = [read_lora_checkpoint(*lora_checkpoint_meta(p)) for p in (ckpt, tmp_path / "m", tmp_path / "z")]
    first = sources[0]
    assert first.has_optimizer and len(first.infos) > 0
    for other in sources[1:]:
        assert sorted(other.infos) == sorted(first.infos) and other.step == first.step == K
        assert [(n, s) for n in first.infos for s in ("param", "exp_avg", "exp_avg_sq")
                if not torch.equal(first.read(n, s), other.read(n, s))] == []
    from safetensors.torch import load_file
    convert(ckpt, tmp_path / "peft_of_zero", to="peft")
    convert(tmp_path / "m", tmp_path / "peft_of_megatron", to="peft")  # back to HF-PEFT: exact
    want, got = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("peft_of_zero", "peft_of_megatron"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_megatron_lora_checkpoint_to_peft_and_hf_equals_its_run_s_exports(lora_runs, tmp_path):
    from safetensors.torch import load_file

    from toolkit.convert import convert
    run = lora_runs["tp2"]
    convert(run, tmp_path / "peft", to="peft")
    convert(run, tmp_path / "hf", to="hf")
    for got, want in ((tmp_path / "peft" / "adapter_model.safetensors", run / "adapter" / "adapter_model.safetensors"),
                      (tmp_path / "hf" / "model.safetensors", run / "hf_final" / "model.safetensors")):
        got, want = load_file(got), load_file(want)
        assert sorted(got) == sorted(want)
        assert [n for n in want if not torch.equal(got[n], want[n])] == []


@pytest.mark.parametrize("family,saved", [("gpt2", []), ("phi3", []), ("llama", ["lm_head", "embed_tokens"])])
def test_megatron_layout_of_packed_projections_and_saved_modules_round_trips(family, saved, tmp_path):
    """Without training: random adapters and moments of GPT-2 (packed ``c_attn``: B as q, k, v row
    blocks), Phi-3 (packed ``qkv_proj`` and ``gate_up_proj``) and Llama with the embedding and head
    trained in full (vocabulary padded for the TP) written as megatron stores them at TP=2 and read
    back equal; each packed B is stored in the row blocks the megatron engine splits it into
    (``Geometry.b_parts``)."""
    import json

    from toolkit.families.tiny import tiny_config
    from toolkit.layout import Layout
    from toolkit.lora.checkpoint import LoraSource, _trained_names, read_lora_checkpoint, write_megatron_lora
    from toolkit.plan import build_plan
    from toolkit.storage import meta as meta_io
    cfg = tiny_config(family, tie_word_embeddings=False) if saved else tiny_config(family)
    spec = build_plan(_lora_cfg(saved), [1], hf_config=cfg).lora.model_dump(mode="json")
    hf_config = json.loads(cfg.to_json_string(use_diff=False))
    g = torch.Generator().manual_seed(0)
    shapes = _trained_shapes(hf_config, spec)
    tensors = {n: {s: torch.randn(shape, generator=g) for s in ("param", "exp_avg", "exp_avg_sq")}
               for n, shape in shapes.items()}
    meta = {"format": "toolkit-megatron", "lora": spec, "layout": {"tp": 2}}
    ckpt = tmp_path / "ckpt"
    write_megatron_lora(LoraSource(ckpt, "test", hf_config, tensors, meta, step=3), ckpt / "engine",
                        layout=Layout.of_sizes("megatron", dp=1, tp=2, vocab_divisor=128), weights_only=False)
    meta_io.write_descriptions(ckpt, "megatron", family, hf_config, meta["layout"], "fp32", {"step": 3}, lora=spec)
    back = read_lora_checkpoint(ckpt, meta)
    assert sorted(back.infos) == sorted(_trained_names(hf_config, spec)) == sorted(tensors)
    assert [(n, s) for n in tensors for s in tensors[n] if not torch.equal(back.read(n, s), tensors[n][s])] == []
    md = _stored_metadata(ckpt / "engine")
    packed = list(_packed_sites(cfg, spec))
    assert bool(packed) == (family != "llama")
    for site, b_name in packed:  # the engine's own split of a packed B, part by part
        from toolkit.families import find_family
        from toolkit.lora.geometry import Geometry
        dims = find_family(family).dims(cfg, cfg.vocab_size)
        want = [tuple(p.shape) for p in Geometry(site, dims, 1, shapes[b_name][0]).b_parts(tensors[b_name]["param"])]
        assert [tuple(md[f"{b_name}.part{k}"].size) for k in range(len(want))] == want
    if saved:
        assert md["embedding.word_embeddings.weight"].size[0] % 2 == 0 and "output_layer.weight" in md


def _lora_cfg(saved):
    from toolkit.config import validate
    return validate({"backend": "megatron", "megatron": {"tp": 1}, "lora": {"rank": 4, "modules_to_save": saved},
                     "train": {"global_batch_size": 4, "micro_batch_size": 1}})


def _trained_shapes(hf_config, spec):
    from toolkit.lora.checkpoint import meta_peft_model
    from toolkit.lora.peft import peft_config
    from toolkit.lora.spec import LoraSpec
    model = meta_peft_model(hf_config, peft_config(LoraSpec(**spec)))
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def _stored_metadata(engine):
    from toolkit.formats.megatron import open_dist
    return open_dist(engine)[1].state_dict_metadata


def _packed_sites(cfg, spec):
    from toolkit.families import find_family
    from toolkit.lora.geometry import megatron_sites
    from toolkit.lora.spec import LoraSpec
    for site in megatron_sites(find_family(cfg.model_type), cfg, LoraSpec(**spec), range(cfg.num_hidden_layers)):
        if site.parts > 1:
            yield site, f"base_model.model.{site.projections[0]}.lora_B.default.weight"


def test_peft_dir_becomes_a_step_0_checkpoint_a_megatron_run_starts_from(lora_runs, tmp_path, data_cache, demo_base):
    """The ZeRO-2 run's adapter/ (HF-PEFT) --to megatron --tp 2: a checkpoint at step 0 without
    optimizer state; a TP=2 run resuming from it starts with that adapter: its first loss is peft's
    loss of base + adapter on the first global batch (computed here)."""
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.config import load_config
    from toolkit.data import global_batch_indices, load_tokenizer, prepare_data
    from toolkit.loss import IGNORE_INDEX
    resumed = tmp_path / "from_peft"
    proc = run_in_process(["convert", str(lora_runs["zero2"] / "adapter"), str(resumed / "checkpoints" / "step_00000000"),
                           "--to", "megatron", "--tp", "2", "--verify"])
    assert "verify: OK" in proc.stdout, proc.stdout[-2000:]
    train(resumed, data_cache, *LORA_RUN, f"model.name_or_path={demo_base}", *TP2, "resume=auto", "train.steps=2")
    assert [r[:2] for r in resumes(resumed)] == [("step_00000000", 0)]
    cfg = load_config(None, [f"model.name_or_path={demo_base}", "data.seq_len=32", f"data.cache_dir={data_cache}"])
    ds = prepare_data(cfg, load_tokenizer(cfg)).train.with_format("torch", columns=["input_ids", "labels"])
    batch = ds[global_batch_indices(len(ds), 8, cfg.train.seed, 0)]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.float32),
                                      lora_runs["zero2"] / "adapter").eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    want = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX).item()
    got = losses(resumed)[0]
    print(f"\nHF-PEFT -> megatron TP2 step 0: first loss {got:.7f}, peft's {want:.7f}")
    assert got == pytest.approx(want, rel=LOSS_RTOL)
