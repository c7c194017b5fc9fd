"""``toolkit convert`` of HF-PEFT directories (``toolkit/lora/convert.py``) against peft itself.

Adapters here are made and saved by peft, not by the toolkit, with what published adapters carry
and a hand-written merge gets wrong: per-module ranks and alphas (``rank_pattern``,
``alpha_pattern``), rsLoRA's alpha / sqrt(r) scaling, GPT-2's transposed Conv1D weights, a module
trained in full, bf16 storage. ``--to hf`` must equal peft's own ``merge_and_unload()`` bit for bit
and ``--verify`` must pass (and fail on a damaged output); adapters that are not W + s x B @ A are
refused by name. The toolkit's own LoRA runs' checkpoints and ``adapter/`` are converted in
tests/e2e/test_lora.py.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from tests.helpers.lora import tiny_bases
from toolkit.convert import ConvertError, convert
from toolkit.families.tiny import tiny_model

ADAPTERS = {
    "llama": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
              "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 3}, "use_rslora": True,
              "modules_to_save": ["lm_head"]},
    "gpt2": {"r": 3, "lora_alpha": 5, "target_modules": ["c_attn", "c_proj"], "fan_in_fan_out": True},
}
"""peft LoraConfig arguments per base family (gpt2: Conv1D, weights stored [in, out])."""


def _peft_adapter(base_dir, family: str, out, dtype=torch.float32, **config):
    """An adapter made by peft on the saved base, every adapter tensor random (B != 0), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(task_type="CAUSAL_LM", **{**ADAPTERS[family], **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1)
    model.to(dtype).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Tiny saved bases (llama untied, gpt2), as paths."""
    return {family: Path(path) for family, path in tiny_bases(tmp_path_factory.mktemp("lora_bases"), ADAPTERS).items()}


def _merged_by_peft(base_dir, adapter_dir) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter_dir)
    return model.merge_and_unload().state_dict()


@pytest.mark.parametrize("family", sorted(ADAPTERS))
def test_peft_dir_to_hf_is_peft_s_merge_and_unload_and_verifies(family, bases, tmp_path):
    from safetensors.torch import load_file

    from toolkit.lora.convert import verify_adapter
    adapter = _peft_adapter(bases[family], family, tmp_path / "adapter")
    summary = convert(adapter, tmp_path / "merged", to="hf")  # the base named in adapter_config.json
    assert summary["to"] == "hf" and summary["from"] == "peft"
    got, want = load_file(tmp_path / "merged" / "model.safetensors"), _merged_by_peft(bases[family], adapter)
    if json.loads((bases[family] / "config.json").read_text()).get("tie_word_embeddings"):
        want.pop("lm_head.weight")  # a tied head is the embedding: saved once, as HF saves it
    assert sorted(got) == sorted(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    base = load_file(bases[family] / "model.safetensors")
    assert sum(not torch.equal(got[n], base[n]) for n in base) >= 2 * 2  # the merge changed each layer
    report = verify_adapter(adapter, tmp_path / "merged", None)
    print(f"\n{family}: --verify {report.lines()}")
    assert report.ok and report.tensors >= len(want) and report.logits_max_diff is not None


def test_verify_finds_a_damaged_merge(bases, tmp_path):
    """A merged output with one weight off by one ulp-sized step fails --verify, naming it."""
    from safetensors.torch import load_file, save_file

    from toolkit.lora.convert import verify_adapter
    adapter = _peft_adapter(bases["llama"], "llama", tmp_path / "adapter")
    convert(adapter, tmp_path / "merged", to="hf")
    weights = tmp_path / "merged" / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.1.self_attn.v_proj.weight"
    tensors[name] = tensors[name] * (1 + 1e-6)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    report = verify_adapter(adapter, tmp_path / "merged", None)
    assert not report.ok and report.mismatched == [name]


def test_bf16_peft_dir_to_peft_is_fp32_and_loads(bases, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.lora.convert import verify_adapter
    adapter = _peft_adapter(bases["llama"], "llama", tmp_path / "adapter", dtype=torch.bfloat16)
    convert(adapter, tmp_path / "fp32", to="peft", base=str(bases["llama"]))
    saved, written = load_file(adapter / "adapter_model.safetensors"), load_file(tmp_path / "fp32" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(written) and {t.dtype for t in written.values()} == {torch.float32}
    assert all(torch.equal(saved[n].float(), written[n]) for n in saved)
    config = json.loads((tmp_path / "fp32" / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {"v_proj": 2} and config["use_rslora"]
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bases["llama"]), tmp_path / "fp32")
    assert verify_adapter(adapter, tmp_path / "fp32", None).ok


def test_a_missing_base_is_named_with_the_fix(bases, tmp_path):
    adapter = _peft_adapter(bases["llama"], "llama", tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/hub-model"}))
    with pytest.raises(ConvertError, match=r"base_model_name_or_path = 'org/hub-model' is not a local HF model "
                                           r"directory .* pass --base DIR"):
        convert(adapter, tmp_path / "out", to="hf")
    convert(adapter, tmp_path / "out", to="hf", base=str(bases["llama"]))  # --base fixes it
    assert not (tmp_path / "out2").exists()


def test_an_adapter_on_another_base_and_unmergeable_adapters_are_refused(bases, tmp_path):
    adapter = _peft_adapter(bases["llama"], "llama", tmp_path / "adapter")
    with pytest.raises(ConvertError, match=r"the adapter does not fit this base \(gpt2\): No modules were targeted"):
        convert(adapter, tmp_path / "out", to="hf", base=str(bases["gpt2"]))
    wider = tmp_path / "wider"
    tiny_model("llama", tie_word_embeddings=False, intermediate_size=80).save_pretrained(wider)
    with pytest.raises(ConvertError, match=r"does not fit this base: .*down_proj.lora_A.default.weight \(4, \d+\) "
                                           r"\(this base needs \(4, 80\)\)"):
        convert(adapter, tmp_path / "out", to="hf", base=str(wider))
    dora = _peft_adapter(bases["llama"], "llama", tmp_path / "dora", use_dora=True)
    with pytest.raises(ConvertError, match=r"not a plain LoRA .*use_dora \(DoRA rescales"):
        convert(dora, tmp_path / "out", to="hf")
    with pytest.raises(ConvertError, match="its rank_pattern, alpha_pattern, use_rslora cannot be said in lora.* "
                                           "settings, so no toolkit run could resume this adapter"):
        convert(adapter, tmp_path / "out", to="zero")  # as a step-0 checkpoint: lora.* cannot say its patterns
    with pytest.raises(ConvertError, match="--base .* applies to LoRA sources only"):
        convert(bases["llama"], tmp_path / "out", to="zero", base=str(bases["llama"]))
    assert not (tmp_path / "out").exists()


def test_cli_converts_and_verifies_a_peft_dir(bases, tmp_path):
    from tests.helpers.runs import run_in_process
    adapter = _peft_adapter(bases["gpt2"], "gpt2", tmp_path / "adapter")
    proc = run_in_process(["convert", str(adapter), str(tmp_path / "merged"), "--to", "hf", "--verify"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "converted peft -> hf" in proc.stdout and "verify: OK" in proc.stdout
