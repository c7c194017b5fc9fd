"""PyTorch distributed checkpoints (DCP) of an FSDP2 model as a converter source (issue 32, first slice).

The checkpoint is written by PyTorch itself: a tiny HF Llama under ``fully_shard`` on 2 gloo ranks,
2 AdamW steps, ``dcp.save({"model": get_model_state_dict, "optim": get_optimizer_state_dict})``. The
reference is what PyTorch gathers from the live FSDP2 model and optimizer
(``StateDictOptions(full_state_dict=True)``), and HF's forward of the reference weights."""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.dcp import STEPS, build_fsdp2_dcp
from tests.helpers.runs import run_cli
from toolkit.convert.inspect import inspect
from toolkit.convert.run import convert
from toolkit.formats.detect import locate, open_source
from toolkit.formats.errors import ConvertError

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> tuple[Path, Path, dict]:
    return build_fsdp2_dcp(tmp_path_factory.mktemp("fsdp2"))


def test_to_hf_gives_the_fsdp2_models_full_state_bit_for_bit_and_its_logits(fsdp2, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.families.tiny import tiny_model
    ckpt, config, reference = fsdp2
    run_cli(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--hf-config", str(config)])
    out = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        out.update(load_file(shard))
    assert sorted(out) == sorted(reference["model"])
    for name, tensor in reference["model"].items():
        assert torch.equal(out[name], tensor), name
    ref_model = tiny_model("llama")
    ref_model.load_state_dict(reference["model"])
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, ref_model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, ref_model(ids).logits)


def test_to_zero_carries_adams_moments_and_step(fsdp2, tmp_path):
    """Each parameter's exp_avg / exp_avg_sq in DeepSpeed's universal files equal the optimizer's own
    full state; the step and the hyperparameters come along."""
    ckpt, config, reference = fsdp2
    summary = convert(ckpt, tmp_path / "zero", to="zero", hf_config=str(config))
    assert summary["from"] == "dcp" and summary["optimizer_state"] and summary["step"] == STEPS
    zero = next((tmp_path / "zero").rglob("zero"))
    state = reference["optim"]["state"]
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(state)
    for name, moments in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            stored = torch.load(zero / name / f"{key}.pt", weights_only=True)["param"]
            assert torch.equal(stored, moments[key]), (name, key)
        assert torch.load(zero / name / "step.pt", weights_only=True) == int(moments["step"]) == STEPS
    hparams = torch.load(zero / "optimizer_state.pt", weights_only=True)["toolkit"]["hparams"]
    assert hparams == {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def test_inspect_names_the_format_and_its_writer_ranks(fsdp2):
    ckpt, config, reference = fsdp2
    assert locate(ckpt, str(config)).format == "dcp"
    described = inspect(ckpt, str(config))
    assert (described["format"], described["layout"], described["step"]) == ("dcp", {"dp": 2}, STEPS)
    assert described["optimizer_state"] and described["tensors"] == len(reference["model"])
    proc = run_cli(["inspect", str(ckpt), "--hf-config", str(config)])
    assert "dcp" in proc.stdout


def test_a_missing_rank_file_and_a_truncated_metadata_are_refused(fsdp2, tmp_path):
    ckpt, config, _ = fsdp2
    shutil.copytree(ckpt, tmp_path / "dcp")
    (tmp_path / "dcp" / "__1_0.distcp").unlink()
    with pytest.raises(ConvertError, match=r"data files \['__1_0.distcp'\] named in .metadata are missing"):
        open_source(tmp_path / "dcp", str(config))
    metadata = (tmp_path / "dcp" / ".metadata").read_bytes()
    (tmp_path / "dcp" / ".metadata").write_bytes(metadata[:len(metadata) // 2])
    with pytest.raises(ConvertError, match=r"not a readable DCP .metadata .*truncated or damaged"):
        open_source(tmp_path / "dcp", str(config))


def test_a_wrong_config_is_refused_naming_the_tensors(fsdp2, tmp_path):
    ckpt, config, _ = fsdp2
    from toolkit.families.tiny import tiny_config
    tiny_config("llama", num_hidden_layers=3).to_json_file(tmp_path / "config.json")
    with pytest.raises(ConvertError, match=r"not the HF llama model's.*unknown \['model.layers.3"):
        open_source(ckpt, str(tmp_path / "config.json"))


class _RunsCode:
    """What a malicious pickle does: a REDUCE of a function with arguments (here ``os.system``)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_malicious_metadata_is_refused_without_running_it(fsdp2, tmp_path):
    ckpt, config, _ = fsdp2
    shutil.copytree(ckpt, tmp_path / "dcp")
    marker = tmp_path / "payload_ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_RunsCode(f"touch {marker}")))
    from toolkit.formats.megatron import open_dist  # megatron's torch_dist reader vets it the same way
    for call in (lambda: open_source(tmp_path / "dcp", str(config)), lambda: open_dist(tmp_path / "dcp"),
                 lambda: convert(tmp_path / "dcp", tmp_path / "out", to="hf", hf_config=str(config))):
        with pytest.raises(ConvertError, match=r"refusing to unpickle (posix|os)\.system"):
            call()
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_metadata_setting_attributes_on_a_dcp_class_is_refused(fsdp2, tmp_path):
    """BUILD onto an allowed class would rewrite DCP's own class for the rest of the process."""
    from torch.distributed.checkpoint.metadata import Metadata
    ckpt, config, _ = fsdp2
    shutil.copytree(ckpt, tmp_path / "dcp")
    # GLOBAL Metadata, then BUILD with a (None, {"planner_data": 1}) slot state: setattr on the class
    payload = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x0c\x00\x00\x00planner_data"
               b"K\x01s\x86b.")
    (tmp_path / "dcp" / ".metadata").write_bytes(payload)
    with pytest.raises(ConvertError, match=r"refusing to unpickle setting attributes on 'Metadata'"):
        open_source(tmp_path / "dcp", str(config))
    assert "planner_data" not in vars(Metadata) or vars(Metadata)["planner_data"] is None


def _save_single_process(folder: Path, model_state: dict, optim: dict) -> None:
    """DCP's own writer, in this process (``no_dist``): the same key layout as an FSDP2 save."""
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model_state, "optim": optim}, checkpoint_id=str(folder), no_dist=True)


def test_a_pickled_hyperparameter_that_runs_code_is_refused(fsdp2, tmp_path):
    """Non-tensor items (param_groups) are pickles inside the .distcp files; DCP's own planner loads
    them with weights_only=False, the reader here with weights_only=True."""
    ckpt, config, reference = fsdp2
    marker = tmp_path / "payload_ran"
    optim = {"state": reference["optim"]["state"], "param_groups": [{"lr": _RunsCode(f"touch {marker}")}]}
    _save_single_process(tmp_path / "dcp", reference["model"], optim)
    with pytest.raises(ConvertError, match=r"refusing to unpickle (posix|os)\.system in optim\.param_groups\.0\.lr"):
        open_source(tmp_path / "dcp", str(config))
    assert not marker.exists()


def test_another_optimizers_state_is_refused_by_name(fsdp2, tmp_path):
    ckpt, config, reference = fsdp2
    state = {n: {"momentum_buffer": torch.zeros_like(t)} for n, t in reference["model"].items()}
    _save_single_process(tmp_path / "dcp", reference["model"], {"state": state})
    with pytest.raises(ConvertError, match=r"optimizer state \['momentum_buffer'\] is not Adam/AdamW's"):
        open_source(tmp_path / "dcp", str(config))


def test_megatron_cores_torch_dist_metadata_passes_the_vetting_unchanged(tmp_path):
    """The megatron format's reader vets its .metadata the same way: megatron-core's own save (with
    its save plans) reads back equal to what DCP's bare ``pickle.load`` gives."""
    from tests.helpers.dcp import save_megatron_engine
    from tests.helpers.ranks import run_ranks
    from toolkit.formats.dcp_metadata import load_metadata
    run_ranks(save_megatron_engine, 2, tmp_path, "qwen2", str(tmp_path / "ckpt"))
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        trusted = pickle.load(f)  # written by this test just now
    vetted = load_metadata(tmp_path / "ckpt")
    assert vetted.all_local_plans  # the save plans are there, and equal
    assert vars(vetted) == vars(trusted)
