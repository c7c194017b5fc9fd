"""A DCP of an FSDP2 model wrapped by peft (LoRA) as a converter source (issue 32).

Written by the libraries themselves: peft's ``get_peft_model`` of a tiny HF Llama, ``fully_shard`` on
2 gloo ranks, 2 AdamW steps on the adapters, ``dcp.save`` of ``get_model_state_dict`` /
``get_optimizer_state_dict``, and peft's adapter_config.json beside it (as HF Trainer writes it). The
reference: peft's own ``PeftModel.from_pretrained`` on the HF base, and the FSDP2 peft model's logits."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.dcp import PEFT_TARGETS, build_fsdp2_peft_dcp, peft_batch
from toolkit.convert.inspect import inspect
from toolkit.convert.run import convert
from toolkit.formats.errors import ConvertError

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

LOGIT_RTOL = 1e-5
"""|logits - FSDP2 peft model's| over its largest |logit|: summation order only (measured below 1e-6)."""


@pytest.fixture(scope="module")
def peft_dcp(tmp_path_factory) -> tuple[Path, Path, dict]:
    return build_fsdp2_peft_dcp(tmp_path_factory.mktemp("peft_dcp"))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert float((got - want).abs().max()) <= LOGIT_RTOL * float(want.abs().max())


def test_inspect_names_it_a_lora_dcp_with_rank_and_targets(peft_dcp):
    """Its line of the format table (tests/distributed/test_formats_table.py has the other formats')."""
    from toolkit.formats.detect import locate
    from toolkit.formats.table import by_name
    ckpt, base, _ = peft_dcp
    found = locate(ckpt, str(base))
    assert (found.format, by_name(found.format).describe(found.path)) == ("dcp (peft LoRA)", {"dp": 2})
    info = inspect(ckpt, str(base))
    assert info["format"] == "dcp (peft LoRA)" and info["rank"] == 4 and info["alpha"] == 8
    assert sorted(info["targets"]) == sorted(PEFT_TARGETS) and info["adapted_layers"] == 8


def test_to_peft_loads_in_peft_with_the_fsdp2_models_adapters_and_logits(peft_dcp, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    ckpt, base, reference = peft_dcp
    summary = convert(ckpt, tmp_path / "adapter", to="peft", hf_config=str(base))
    assert summary["from"] == "dcp (peft LoRA)" and summary["tensors"] == 17
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      str(tmp_path / "adapter")).eval()
    state = model.state_dict()
    for name, tensor in reference["model"].items():
        assert torch.equal(state[name], tensor), name
    with torch.no_grad():
        _close(model(input_ids=peft_batch(model.config.vocab_size)).logits, reference["logits"])


def test_to_hf_is_peft_merge_and_unload_of_it(peft_dcp, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    ckpt, base, reference = peft_dcp
    convert(ckpt, tmp_path / "adapter", to="peft", hf_config=str(base))
    convert(ckpt, tmp_path / "hf", to="hf", hf_config=str(base))
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(tmp_path / "adapter")).merge_and_unload().state_dict()
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert sorted(out.state_dict()) == sorted(merged)
    for name, tensor in out.state_dict().items():
        assert torch.equal(tensor, merged[name]), name
    with torch.no_grad():
        _close(out(input_ids=peft_batch(out.config.vocab_size)).logits, reference["logits"])


def test_accelerates_layout_with_the_trainers_adapter_config_converts_the_same(peft_dcp, tmp_path):
    """HF Trainer's ``checkpoint-N/``: the DCP in ``pytorch_model_fsdp_0/``, adapter_config.json in
    ``checkpoint-N/`` itself; and a toolkit LoRA checkpoint's torch_dist directory is not taken for one."""
    from safetensors.torch import load_file

    from toolkit.formats.peft import find_peft_dcp
    ckpt, base, _ = peft_dcp
    trainer = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt, trainer / "pytorch_model_fsdp_0")
    (trainer / "pytorch_model_fsdp_0" / "adapter_config.json").rename(trainer / "adapter_config.json")
    convert(ckpt, tmp_path / "plain", to="peft", hf_config=str(base))
    convert(trainer, tmp_path / "trainer", to="peft", hf_config=str(base))
    plain, got = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("plain", "trainer"))
    assert sorted(plain) == sorted(got) and all(torch.equal(plain[k], got[k]) for k in plain)
    (trainer / "meta.json").write_text('{"lora": {}}')
    assert find_peft_dcp(trainer / "pytorch_model_fsdp_0") is None


def test_refusals_name_the_problem(peft_dcp, tmp_path):
    ckpt, base, _ = peft_dcp
    with pytest.raises(ConvertError, match="--to peft or --to hf"):
        convert(ckpt, tmp_path / "zero", to="zero", hf_config=str(base))
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    (bare / "adapter_config.json").unlink()
    with pytest.raises(ConvertError, match=r"rank \[4\], targets \['q_proj', 'v_proj'\].*adapter_config.json"):
        convert(bare, tmp_path / "out", to="peft", hf_config=str(base))
