"""The format table (toolkit/formats/table.py): every registered format recognises a checkpoint its
writer produced (the toolkit's own writer, or DeepSpeed / megatron-core for the formats the toolkit
only reads), opens it with its reader (tensors equal to the HF model's state dict), and its
``describe`` gives back the layout the writer was asked for.

The expected layout records and ``toolkit_megatron.json`` are written out literally here on purpose:
they are what checkpoints written before the table carry, so old checkpoints keep loading."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.families.tiny import tiny_model
from toolkit.formats.canonical import WriteRequest
from toolkit.formats.detect import locate, open_located, open_source
from toolkit.formats.errors import ConvertError
from toolkit.formats.table import FORMATS, TARGETS, by_name, for_target
from toolkit.layout import Layout

FAMILY = "qwen2"  # tied embeddings, vocab 250: padded to 256 at tp=2 with divisor 64
LAYOUTS = {backend: Layout.of_sizes(backend, dp=2, tp=2 if backend == "megatron" else 1, zero_stage=3, vocab_divisor=64)
           for backend in ("deepspeed", "megatron")}
REQUEST = WriteRequest(layout=LAYOUTS["megatron"])
WRITTEN = {
    "hf": {},
    "megatron": {"dp": 2, "tp": 2, "pp": 1, "vpp": None, "ep": 1, "format": "torch_dist"},
    "zero-universal": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3},
    "dcp": {"dp": 1},  # one writer rank: DCP reshards at load
    "accelerate": {"dp": 1},
}
"""Layout records the toolkit's writers produce for ``request`` (megatron's layout, or ZeRO's for zero-universal)."""
READ_ONLY = {"zero": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3}, "megatron-legacy": {"tp": 2, "pp": 1},
             "dcp": {"dp": 2}, "torchtitan": {"dp": 1}}
"""Checkpoints written by DeepSpeed / Megatron-LM / PyTorch DCP themselves (the slow cases below, at DP 2 / TP 2;
torchtitan's layout through DCP in one process, tests/helpers/torchtitan.py)."""
ADAPTERS = {"peft": {}, "toolkit-deepspeed (LoRA)": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 2},
            "toolkit-megatron (LoRA)": {"dp": 2, "tp": 2, "pp": 1, "vpp": None, "ep": 1, "format": "torch_dist"},
            "dcp (peft LoRA)": {"dp": 2}}
"""LoRA adapters, converted whole (``lora/``): peft's own save, and the toolkit's LoRA checkpoints written from
it (below); the DCP of a peft model FSDP2 saved on 2 ranks is tests/distributed/test_dcp_peft.py's case."""
MEGATRON_DESCRIPTION = {
    "format": "megatron-core torch_dist", "family": "qwen2", "vocab_size": 250, "padded_vocab_size": 256,
    "make_vocab_size_divisible_by": 64, "layer_spec": "gpt_layer_local_spec",
    "optimizer_sharding": "fully_reshardable", "layout": WRITTEN["megatron"]}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> tuple[Path, dict]:
    model = tiny_model(FAMILY)
    path = tmp_path_factory.mktemp("table") / "hf"
    model.save_pretrained(path, safe_serialization=True)
    return path, model.state_dict()


def test_every_registered_format_is_tested_here():
    """A new format is registered in the table and gets its case here."""
    assert {f.name for f in FORMATS} == set(WRITTEN) | set(READ_ONLY) | set(ADAPTERS)
    assert {f.name for f in FORMATS if f.writer} == set(WRITTEN)
    assert {f.name for f in FORMATS if f.adapters} == set(ADAPTERS)
    assert TARGETS == ("hf", "megatron", "zero", "dcp", "accelerate", "peft")


def test_lora_adapters_are_detected_described_and_refused_as_a_stream(tmp_path):
    """A peft adapter directory and the ZeRO / megatron LoRA checkpoints converted from it are found by
    their own lines of the table (a LoRA checkpoint also from its engine/), described with the layout
    they were written at, and refused as a model's stream with the command that converts them."""
    from peft import LoraConfig, get_peft_model

    from toolkit.convert import convert
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "peft")
    convert(tmp_path / "peft", tmp_path / "zero", to="zero", base=str(tmp_path / "base"))
    convert(tmp_path / "zero", tmp_path / "megatron", to="megatron", tp=2, dp=2)
    cases = {"peft": tmp_path / "peft", "toolkit-deepspeed (LoRA)": tmp_path / "zero",
             "toolkit-megatron (LoRA)": tmp_path / "megatron"}
    for name, path in cases.items():
        for where in (path, path / "engine") if name != "peft" else (path,):
            found = locate(where)
            assert (found.format, found.path) == (name, path)
        assert by_name(name).describe(found.path) == ADAPTERS[name]
        with pytest.raises(ConvertError, match="it converts only as a whole: toolkit convert"):
            open_located(found)
    with pytest.raises(ConvertError, match="--to peft: writes LoRA adapters, from a LoRA source only"):
        convert(tmp_path / "base", tmp_path / "out", to="peft")


def test_a_lora_checkpoint_is_located_once_per_convert_and_verify(tmp_path, monkeypatch, capsys):
    """``toolkit convert --verify`` of a LoRA checkpoint finds its format once, for the conversion and
    the verification (it probed the source's LoRA files six times and more before the table had them)."""
    from peft import LoraConfig, get_peft_model

    from toolkit.cli import main
    from toolkit.formats import detect
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path / "base")
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "peft")
    main(["convert", str(tmp_path / "peft"), str(tmp_path / "zero"), "--to", "zero", "--base", str(tmp_path / "base")])
    located = []
    real = detect.locate
    monkeypatch.setattr(detect, "locate", lambda path, *a, **kw: located.append(str(path)) or real(path, *a, **kw))
    for to, out in (("megatron", "megatron"), ("peft", "adapter")):
        assert main(["convert", str(tmp_path / "zero"), str(tmp_path / out), "--to", to, "--verify"]) == 0
        assert "verify: OK" in capsys.readouterr().out
    assert located == [str(tmp_path / "zero")] * 2


def _write(fmt, hf_dir: Path, out: Path) -> dict:
    """``fmt``'s writer as the convert command calls it: a backend's format under ``engine/``."""
    out.mkdir()
    request = WriteRequest(layout=LAYOUTS["deepspeed"]) if fmt.backend == "deepspeed" else REQUEST
    return fmt.write(open_source(hf_dir), out / "engine" if fmt.backend else out, request)


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_writer_output_is_detected_read_and_described_as_written(hf_model, tmp_path, name):
    hf_dir, state = hf_model
    fmt = by_name(name)
    record = _write(fmt, hf_dir, tmp_path / "out")
    found = locate(tmp_path / "out", hf_config=str(hf_dir))
    assert found.format == name
    assert record == fmt.describe(found.path) == WRITTEN[name]
    source = open_located(found)
    try:
        assert sorted(source.names()) == sorted(n for n in state if n != "lm_head.weight")  # tied
        for n in source.names():
            assert torch.equal(source.read(n), state[n]), n
    finally:
        source.close()


def test_megatron_description_keeps_its_keys_and_values(hf_model, tmp_path):
    _write(by_name("megatron"), hf_model[0], tmp_path / "out")
    assert json.loads((tmp_path / "out" / "engine" / "toolkit_megatron.json").read_text()) == MEGATRON_DESCRIPTION


def test_targets_name_their_formats_and_an_unknown_one_is_refused():
    assert {to: for_target(to).name for to in TARGETS} == {"hf": "hf", "megatron": "megatron", "zero": "zero-universal",
                                                           "dcp": "dcp", "accelerate": "accelerate", "peft": "peft"}
    with pytest.raises(ConvertError, match=r"--to 'zarr': choose one of \['hf', 'megatron', 'zero', 'dcp', 'accelerate', "
                                           r"'peft'\]"):
        for_target("zarr")
    with pytest.raises(ConvertError, match="the zero format is read only"):
        by_name("zero").write(None, Path("."), REQUEST)


@pytest.mark.slow
def test_deepspeed_zero_checkpoint_is_detected_read_and_described(tmp_path_factory):
    from tests.helpers.convert import build_zero_checkpoints
    root = build_zero_checkpoints(tmp_path_factory, "table_zero", [(FAMILY, 3, 2)])
    found = locate(root / f"{FAMILY}-z3-dp2")
    assert found.format == "zero"
    assert by_name("zero").describe(found.path) == READ_ONLY["zero"]
    source = open_located(found)
    assert source.layout == READ_ONLY["zero"] and source.names()


@pytest.mark.slow
def test_megatron_legacy_checkpoint_is_detected_read_and_described(tmp_path):
    from tests.helpers.convert import save_legacy_megatron, write_config
    from tests.helpers.ranks import run_ranks
    root = tmp_path / "legacy"
    held = run_ranks(save_legacy_megatron, 2, tmp_path, FAMILY, 2, 1, str(root))[0]["weights"]
    write_config(root, FAMILY)
    found = locate(root)
    assert found.format == "megatron-legacy"
    assert by_name("megatron-legacy").describe(found.path) == READ_ONLY["megatron-legacy"]
    source = open_located(found)
    for n in source.names():
        assert torch.equal(source.read(n), held[n]), n


@pytest.mark.slow
def test_fsdp2_dcp_checkpoint_is_detected_read_and_described(tmp_path):
    """FSDP2 + ``torch.distributed.checkpoint`` on 2 ranks (tests/helpers/dcp.py), tied embeddings."""
    from tests.helpers.dcp import build_fsdp2_dcp
    ckpt, config, reference = build_fsdp2_dcp(tmp_path, FAMILY)
    found = locate(ckpt, hf_config=str(config))
    assert found.format == "dcp"
    assert by_name("dcp").describe(found.path) == READ_ONLY["dcp"]
    source = open_located(found)
    assert source.layout == READ_ONLY["dcp"]
    assert sorted(source.names()) == sorted(n for n in reference["model"] if n != "lm_head.weight")  # tied
    for n in source.names():
        assert torch.equal(source.read(n), reference["model"][n]), n


def test_torchtitan_checkpoint_is_detected_read_and_described(tmp_path):
    """A torchtitan ``step-N/`` of a tiny Qwen 3 (tests/helpers/torchtitan.py: torchtitan's names, DCP)."""
    from tests.helpers.torchtitan import save_titan
    model = tiny_model("qwen3", num_hidden_layers=1)
    ckpt = save_titan(tmp_path, model, step=3)
    model.config.to_json_file(tmp_path / "config.json")
    found = locate(ckpt, hf_config=str(tmp_path / "config.json"))
    assert found.format == "torchtitan"
    assert by_name("torchtitan").describe(found.path) == READ_ONLY["torchtitan"]
    source = open_located(found)
    assert source.layout == READ_ONLY["torchtitan"] and source.step == 3
    held = model.state_dict()
    assert sorted(source.names()) == sorted(held)
    for n in source.names():
        assert torch.equal(source.read(n), held[n]), n


def test_the_command_line_offers_the_tables_targets_and_sources():
    """``convert --to`` choices and the SRC / PATH help are the table's, not a second list."""
    import argparse

    from toolkit.cli import _parser
    from toolkit.formats.table import SOURCES_HELP
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    convert, inspect = commands.choices["convert"], commands.choices["inspect"]
    action = {a.dest: a for a in convert._actions}
    assert tuple(action["to"].choices) == TARGETS
    assert action["src"].help == SOURCES_HELP == next(a for a in inspect._actions if a.dest == "path").help
    assert all(f.help and f.help in SOURCES_HELP for f in FORMATS)
