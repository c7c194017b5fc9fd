"""torchtitan checkpoints (``step-N/``) as a converter source (issue 32, torchtitan slice).

torchtitan cannot be installed here, so ``tests/helpers/torchtitan.py`` builds its checkpoints: an HF
tiny model's state under torchtitan's own names and layout, written by ``torch.distributed.checkpoint``
as torchtitan's ``CheckpointManager`` writes it. The layout is not taken on trust: a re-implementation
of torchtitan's forward (complex RoPE on adjacent pairs for Llama 3) over that state gives HF's logits
first. The reference is the HF model itself (its tensors, its Adam moments and its logits)."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import run_cli
from tests.helpers.torchtitan import NEW, OLD, hf_moments, save_titan, titan_logits, titan_state, train_hf
from tests.helpers.zoo import VARIANTS
from toolkit.convert.inspect import inspect
from toolkit.convert.run import convert
from toolkit.formats.detect import open_source
from toolkit.formats.errors import ConvertError

STEPS = 2
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


def _config(model, folder: Path) -> Path:
    model.config.to_json_file(folder / "config.json")
    return folder / "config.json"


def _hf_out(folder: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for shard in folder.glob("*.safetensors"):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama after 2 AdamW steps, saved as torchtitan's full training checkpoint."""
    from toolkit.families.tiny import tiny_model
    root = tmp_path_factory.mktemp("titan")
    model = tiny_model("llama").train()
    opt = train_hf(model, STEPS)
    ckpt = save_titan(root / "checkpoint", model, opt, step=STEPS)
    return ckpt, _config(model, root), model.eval(), opt


def test_the_fixture_is_torchtitans_layout_its_forward_gives_hfs_logits(trained):
    import torch.distributed.checkpoint as dcp
    ckpt, _, model, _ = trained
    saved = {k: torch.empty_like(v) for k, v in titan_state(model.state_dict(), model.config).items()}
    dcp.load(saved, checkpoint_id=str(ckpt), no_dist=True)  # what the checkpoint holds, read by DCP itself
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        diff = (titan_logits(saved, model.config, ids) - model(ids).logits).abs().max().item()
    assert diff < 1e-5, diff  # measured 1.8e-7 (the q/k rows left in HF's order: 5e-3)


def test_convert_to_hf_gives_the_model_bit_for_bit_and_its_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM
    ckpt, config, model, _ = trained
    run_cli(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--hf-config", str(config)])
    out = _hf_out(tmp_path / "hf")
    assert sorted(out) == sorted(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(out[name], tensor), name
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, model(ids).logits)


def test_adams_moments_and_step_reach_zero_in_hfs_layout(trained, tmp_path):
    ckpt, config, model, opt = trained
    summary = convert(ckpt, tmp_path / "zero", to="zero", hf_config=str(config))
    assert summary["from"] == "torchtitan" and summary["optimizer_state"] and summary["step"] == STEPS
    zero = next((tmp_path / "zero").rglob("zero"))
    moments = hf_moments(model, opt)
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(moments)
    for name, state in moments.items():
        for key in ("exp_avg", "exp_avg_sq"):
            stored = torch.load(zero / name / f"{key}.pt", weights_only=True)["param"]
            assert torch.equal(stored, state[key]), (name, key)
        assert torch.load(zero / name / "step.pt", weights_only=True) == STEPS
    hparams = torch.load(zero / "optimizer_state.pt", weights_only=True)["toolkit"]["hparams"]
    assert hparams == {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def test_inspect_says_torchtitan_the_family_and_the_step(trained):
    ckpt, config, model, _ = trained
    described = inspect(ckpt, str(config))
    assert (described["format"], described["family"], described["step"]) == ("torchtitan", "llama", STEPS)
    assert described["optimizer_state"] and described["tensors"] == len(model.state_dict())


@pytest.mark.parametrize("variant,names", [("llama-tied-llama3", NEW), ("llama-mqa-linear-hd", OLD),
                                           ("qwen3-tied-hd-mqa", NEW)])
def test_model_only_zoo_variants_convert_bit_for_bit(variant, names, tmp_path):
    """Tied embeddings (torchtitan keeps ``lm_head`` too), one KV head, head_dim apart from hidden /
    heads, Qwen 3's q/k norms and rotate-half RoPE; torchtitan's older names (``attention.wq``,
    ``output``) as well as its current ones; a weights-only save takes its step from ``step-N``."""
    model = VARIANTS[variant].model().eval()
    ckpt = save_titan(tmp_path, model, step=7, names=names)
    config = _config(model, tmp_path)
    source = open_source(ckpt, str(config))
    try:
        assert (source.format, source.model_type, source.step, source.has_optimizer) == \
            ("torchtitan", model.config.model_type, 7, False)
    finally:
        source.close()
    convert(ckpt, tmp_path / "hf", to="hf", hf_config=str(config))
    out, want = _hf_out(tmp_path / "hf"), model.state_dict()
    want.pop("lm_head.weight", None)
    out.pop("lm_head.weight", None)
    assert sorted(out) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(out[name], tensor), name


def test_unknown_torchtitan_names_are_refused_by_name(tmp_path):
    """A tensor outside the family's torchtitan table (a MoE router here), a config of another family
    (llama's for a Qwen 3 checkpoint: its q/k norms are unknown) and a family torchtitan has no model of."""
    import torch.distributed.checkpoint as dcp

    from toolkit.families.tiny import tiny_config, tiny_model
    model = tiny_model("qwen3", num_hidden_layers=1).eval()
    sd = titan_state(model.state_dict(), model.config)
    dcp.save({**sd, "layers.0.moe.router.gate.weight": torch.zeros(4, 64)}, checkpoint_id=str(tmp_path / "moe"),
             no_dist=True)
    config = _config(model, tmp_path)
    with pytest.raises(ConvertError, match=r"torchtitan names \['layers.0.moe.router.gate.weight'\]"):
        open_source(tmp_path / "moe", str(config))
    ckpt = save_titan(tmp_path, model, step=1)
    llama = tmp_path / "llama.json"
    tiny_config("llama", num_hidden_layers=1).to_json_file(llama)
    with pytest.raises(ConvertError, match=r"attention.k_norm.weight.*not in the llama family's torchtitan table"):
        open_source(ckpt, str(llama))
    mistral = tmp_path / "mistral.json"
    mistral.write_text(json.dumps({**json.loads(llama.read_text()), "model_type": "mistral"}))
    with pytest.raises(ConvertError, match=r"'mistral' has no torchtitan names.*\['llama', 'qwen3'\]"):
        open_source(ckpt, str(mistral))


class _RunsCode:
    """A malicious pickle: a REDUCE of ``os.system`` with a command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_malicious_metadata_carrying_torchtitans_names_is_refused_without_running_it(tmp_path):
    """Detection finds torchtitan's embedding name among the bytes without unpickling; the reader's
    allowlist then refuses the payload."""
    from toolkit.families.tiny import tiny_model
    model = tiny_model("llama", num_hidden_layers=1)
    ckpt = save_titan(tmp_path, model, step=1)
    config = _config(model, tmp_path)
    marker = tmp_path / "payload_ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps({"tok_embeddings.weight": _RunsCode(f"touch {marker}")}))
    for call in (lambda: open_source(ckpt, str(config)),
                 lambda: convert(ckpt, tmp_path / "out", to="hf", hf_config=str(config))):
        with pytest.raises(ConvertError, match=r"refusing to unpickle (posix|os)\.system"):
            call()
    assert not marker.exists() and not (tmp_path / "out").exists()
