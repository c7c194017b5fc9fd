"""Converter pieces that need no process group: HF <-> Megatron <-> ZeRO round trips of every family
in process, the megatron key map against megatron-core's own spec, the pickle allowlist."""
from __future__ import annotations

import pytest
import torch

from toolkit.convert import ConvertError, convert, open_source
from toolkit.families.tiny import tiny_model
from toolkit.formats.safeload import safe_load


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral", "qwen3", "gemma", "phi3", "gemma2"])
def test_hf_megatron_hf_zero_round_trip_exact(tmp_path, monkeypatch, family):
    monkeypatch.setattr("toolkit.formats.megatron.ROW_BLOCK_BYTES", 4096)  # vocab rows in blocks
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    state = model.state_dict()
    convert(tmp_path / "hf", tmp_path / "meg", to="megatron", tp=2, pp=2)
    convert(tmp_path / "meg", tmp_path / "hf2", to="hf")
    convert(tmp_path / "hf2", tmp_path / "zero", to="zero", dp=3, zero_stage=1)
    for path in ("meg", "hf2", "zero"):
        src = open_source(tmp_path / path)
        for name in src.names():
            assert torch.equal(src.read(name), state[name]), (path, name)
        assert ("lm_head.weight" in src.names()) == (not model.config.tie_word_embeddings)
    from transformers import AutoModelForCausalLM
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_keys_map_is_megatron_local_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from toolkit.formats.megatron import KEYS_MAP
    for norm in ("RMSNorm", "LayerNorm"):
        assert get_gpt_layer_local_spec(normalization=norm).submodules.sharded_state_dict_keys_map == KEYS_MAP


def test_pickle_allowlist(tmp_path):
    import argparse
    torch.save({"w": torch.ones(2), "steps": [1, 2], "parser": argparse.ArgumentParser}, tmp_path / "x.pt")
    with pytest.raises(ConvertError, match=r"refusing to unpickle argparse\.ArgumentParser"):
        safe_load(tmp_path / "x.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    assert torch.equal(safe_load(tmp_path / "ok.pt")["w"], torch.ones(2))
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:100])
    with pytest.raises(ConvertError, match="truncated"):
        safe_load(tmp_path / "cut.pt")


def test_dcp_items_a_gpu_wrote_load_on_the_cpu(monkeypatch):
    """A GPU run's DCP optimizer items may pickle CUDA tensors (a capturable Adam's ``lr``): the converter
    reads them on a CPU machine (``map_location="cpu"``; without it torch asks for CUDA)."""
    import io

    from toolkit.formats.dcp import unpickle_item
    buf = io.BytesIO()
    with monkeypatch.context() as m:  # torch.save records each storage's device as location_tag says
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"lr": torch.tensor(3e-4), "betas": (0.9, 0.95)}, buf)
    assert b"cuda:0" in buf.getvalue()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    item = unpickle_item(buf.getvalue(), "ckpt", "optim.param_groups.0.lr")
    assert item["lr"].device.type == "cpu" and item["lr"].item() == pytest.approx(3e-4)


@pytest.mark.parametrize("to, flags", [("zero", {"dp": 0}), ("megatron", {"dp": 0}), ("zero", {"dp": -2})])
def test_a_data_parallel_size_below_one_is_refused_not_read_as_the_default(tmp_path, to, flags):
    """``convert --dp 0`` wrote a checkpoint described for dp 1 (``dp or 1``)."""
    tiny_model("llama", num_hidden_layers=1).save_pretrained(tmp_path / "hf", safe_serialization=True)
    with pytest.raises(ConvertError, match=rf"--dp {flags['dp']}: each must be >= 1"):
        convert(tmp_path / "hf", tmp_path / "out", to=to, **flags)
    assert not (tmp_path / "out").exists()


class _RunsCommand:
    """Pickles as a call of os.system (``posix.system`` on Linux): what a malicious checkpoint holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os
        return os.system, (self.command,)


def test_a_blocked_global_is_named_and_never_offered_to_trust(tmp_path):
    """torch 2.13 words a global of a blocked module (os, sys, posix, nt) as "Trying to load unsupported
    GLOBAL posix.system whose module posix is blocked."; the refusal read "refusing to unpickle an unlisted
    class" and suggested TOOLKIT_TRUST_PICKLE_CLASSES=an unlisted class, which torch would refuse anyway."""
    marker = tmp_path / "payload_ran"
    torch.save({"w": torch.ones(2), "x": _RunsCommand(f"touch {marker}")}, tmp_path / "evil.pt")
    with pytest.raises(ConvertError) as caught:
        safe_load(tmp_path / "evil.pt")
    message = str(caught.value)
    assert "refusing to unpickle posix.system" in message or "refusing to unpickle os.system" in message, message
    assert "an unlisted class" not in message and "TOOLKIT_TRUST_PICKLE_CLASSES" not in message, message
    assert "torch never loads" in message and "do not use this file" in message, message
    assert not marker.exists()


def test_an_unlisted_class_is_named_with_how_to_trust_it(tmp_path, monkeypatch):
    from fractions import Fraction
    torch.save({"w": torch.ones(2), "ratio": Fraction(1, 3)}, tmp_path / "x.pt")
    with pytest.raises(ConvertError, match=r"refusing to unpickle fractions\.Fraction: .* "
                                           r"TOOLKIT_TRUST_PICKLE_CLASSES=fractions\.Fraction toolkit convert"):
        safe_load(tmp_path / "x.pt")
    monkeypatch.setenv("TOOLKIT_TRUST_PICKLE_CLASSES", "fractions.Fraction")
    assert safe_load(tmp_path / "x.pt")["ratio"] == Fraction(1, 3)


def test_torch_free_unpickler_reads_tensor_locations_and_lets_nothing_be_rewritten(tmp_path):
    """torchzip against torch.save itself: a tensor's record points at its bytes in the file. A
    pickle that tries to set state on an allowed function, or a tensor starting before its storage,
    is refused (the caller then takes the torch reader)."""
    import pickle

    from toolkit.formats import torchzip
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save({"w": t[1:]}, tmp_path / "x.pt")
    rec = torchzip.load(tmp_path / "x.pt")["w"]
    path, offset, nbytes = rec.byte_range(0, rec.numel())
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(nbytes) == t[1:].contiguous().numpy().tobytes()
    build_on_function = pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.EMPTY_DICT + pickle.BUILD + b"."
    with pytest.raises(torchzip.Unsupported, match="setting state"):
        torchzip._Unpickler(b"\x80\x02" + build_on_function, None).load()
    assert torchzip._rebuild_tensor.__defaults__ == (None,)
    before = torchzip.Tensor(rec.storage, -4, (4,), (1,))
    with pytest.raises(torchzip.Unsupported, match="outside its storage"):
        before.byte_range(0, 4)


def test_a_config_with_little_more_than_model_type_is_refused_naming_the_fields(tmp_path):
    """transformers fills a missing field with its class default (a 4096-wide Llama): the converter
    must name what config.json lacks instead (before: TypeError: unsupported operand ... NoneType)."""
    import json

    from safetensors.torch import save_file
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ConvertError, match=r"has no num_hidden_layers, num_attention_heads, intermediate_size, "
                                           r"vocab_size: the megatron layout needs each"):
        convert(tmp_path / "hf", tmp_path / "meg", to="megatron")
    assert not (tmp_path / "meg").exists()


def _save_pickled(model, out, shards: int = 2) -> None:
    """What transformers < 5 wrote with safe_serialization=False: pytorch_model-*.bin + index."""
    import json
    out.mkdir()
    model.config.save_pretrained(out)
    names = list(model.state_dict())
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: t.contiguous() for n, t in model.state_dict().items() if names.index(n) % shards == i}
        torch.save(part, out / file)
        weight_map.update(dict.fromkeys(part, file))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_pickled_checkpoints_are_read_as_data_only(tmp_path):
    """pytorch_model*.bin sources go through the allowlisted unpickler (tensors, never code), sharded
    with their index, at TP=2 by slice; a pickle holding anything else is refused by name."""
    model = tiny_model("llama")
    _save_pickled(model, tmp_path / "bin")
    convert(tmp_path / "bin", tmp_path / "meg", to="megatron", tp=2)
    convert(tmp_path / "meg", tmp_path / "hf", to="hf")
    src, state = open_source(tmp_path / "hf"), model.state_dict()
    assert sorted(src.names()) == sorted(state)
    for name in src.names():
        assert torch.equal(src.read(name), state[name]), name
    evil = tmp_path / "evil"
    _save_pickled(model, evil, shards=1)
    torch.save({"model.norm.weight": torch.ones(64), "payload": _NotAllowed()}, evil / "pytorch_model-00001-of-00001.bin")
    with pytest.raises(ConvertError, match="_NotAllowed"):
        convert(evil, tmp_path / "never", to="megatron")
    assert not (tmp_path / "never").exists()


class _NotAllowed:
    """Stands for any class a pickle may name to run code on load."""


def test_inspect_says_where_an_hf_model_can_train(tmp_path):
    """``toolkit inspect`` of an HF directory: the family, the TP sizes that divide its heads and KV
    heads, the PP sizes that divide its layers, EP sizes for experts; or why megatron cannot run it."""
    import json

    from tests.helpers.runs import run_in_process
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path / "moe", safe_serialization=True)
    info = json.loads(run_in_process(["inspect", str(tmp_path / "moe"), "--json"]).stdout)
    assert info["family"] == "qwen3_moe" and info["deepspeed"] == "ZeRO 0-3"
    assert info["megatron"].startswith("tp in [1, 2], pp in [1, 2] (or uneven") and info["megatron"].endswith(
        "ep in [1, 2, 4]")
    assert "cp in [1, 2, 4] at tp=1" in info["megatron"]  # 4 heads: context parallelism splits them
    tiny_model("qwen3_moe", mlp_only_layers=[1]).save_pretrained(tmp_path / "dense1", safe_serialization=True)
    info = json.loads(run_in_process(["inspect", str(tmp_path / "dense1"), "--json"]).stdout)
    assert "mlp_only_layers=[1] is not supported by the megatron path" in info["megatron"]
