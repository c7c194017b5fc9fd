"""No rank holds the whole model to build it: ZeRO-3 ranks fill their partitions (reading only their
elements of a checkpoint), megatron TP/PP ranks read only their slices, and the seeded random init
gives every backend, layout and DP size the same weights, module by module. Exports stream."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.ranks import run_ranks
from toolkit.adapters import hf
from toolkit.config import validate
from toolkit.families.tiny import TINY, TINY_MOE, tiny_config, tiny_model
from toolkit.plan import build_plan

FAMILIES = sorted(TINY) + sorted(TINY_MOE)


def plan_for(family: str, world: int = 1, **sections):
    cfg = validate({"train": {"global_batch_size": 4, "micro_batch_size": 1, "seed": 11}, **sections})
    return build_plan(cfg, [world], hf_config=tiny_config(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_init_is_hf_init_module_by_module(family):
    """Every parameter drawn (none left uninitialized), with HF's own rules: the same statistics as
    transformers' ``from_config`` (normal(0, initializer_range) matrices, ones for norms, zeros for
    biases and the padding row), and the same values whichever module is drawn first."""
    model = hf.build_model(plan_for(family))
    reference = tiny_model(family, seed=5)  # HF's own init (tiny_model perturbs 1-D tensors: skip those)
    weights = hf.SeededWeights(model.config, 11)
    for unit in reversed(weights.units):  # drawn in another order: the same values
        for name, tensor in weights.unit_tensors(unit).items():
            assert torch.equal(tensor, model.get_parameter(name)), name
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        ref = reference.get_parameter(name)
        if param.ndim >= 2:  # (GPT-2's c_proj: std / sqrt(2 x layers), drawn by its block)
            assert abs(param.std().item() - ref.std().item()) < 0.15 * ref.std().item() + 1e-6, name
    pad = getattr(model.config, "pad_token_id", None)
    if pad is not None:
        assert model.get_input_embeddings().weight[pad].abs().sum() == 0


def test_seeded_init_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    hf.build_model(plan_for("llama"))
    assert torch.equal(torch.get_rng_state(), before)


def _counting_reads(source_class):
    """Wrap the converter's HF reader so every slice read is counted (elements)."""
    counted = {"elements": 0}
    original = source_class.slice_of

    class Counted:
        def __init__(self, part):
            self.part = part

        def __getitem__(self, index):
            out = self.part[index]
            counted["elements"] += out.numel()
            return out

        def get_shape(self):
            return self.part.get_shape()

    source_class.slice_of = lambda self, name: Counted(original(self, name))
    return counted


def _zero3_rank(rank, world, model_dir, family):
    from toolkit.adapters import deepspeed as ds_adapter
    from toolkit.formats.hf import HFSource
    counted = _counting_reads(HFSource)
    cfg = validate({"model": {"name_or_path": str(model_dir), "init": "pretrained"}, "zero": {"stage": 3},
                    "train": {"global_batch_size": 4, "micro_batch_size": 1}})
    plan = build_plan(cfg, [world])
    model = ds_adapter.build_model(plan, plan.ds_config(world))
    mine = sum(p.ds_tensor.numel() for p in model.parameters())
    import deepspeed
    whole = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            whole[name] = p.detach().clone()
    seeded = build_plan(validate({"zero": {"stage": 3}, "train": {"global_batch_size": 4, "micro_batch_size": 1,
                                                                  "seed": 11}}), [world], hf_config=tiny_config(family))
    random_model = ds_adapter.build_model(seeded, seeded.ds_config(world))
    randoms = {}
    for name, p in random_model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            randoms[name] = p.detach().clone()
    return {"read": counted["elements"], "partition": mine, "weights": whole, "random": randoms}


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])  # tied embeddings; packed MoE experts
def test_zero3_ranks_read_only_their_elements_and_build_the_same_model(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    ranks = run_ranks(_zero3_rank, 2, tmp_path, tmp_path / "model", family)
    total = sum(p.numel() for p in model.parameters())
    for r in ranks:
        assert r["read"] <= r["partition"] <= total / 2 + 2 * len(r["weights"])  # its partition, padding at most
        assert r["read"] >= r["partition"] - 2 * len(r["weights"])
    assert sum(r["read"] for r in ranks) == total  # every element read once, by one rank
    expected = model.state_dict()
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, expected[name]), name
    seeded = hf.build_model(plan_for(family))
    for name, tensor in ranks[1]["random"].items():
        assert torch.equal(tensor, seeded.get_parameter(name)), name


def _megatron_rank(rank, world, model_dir, tp, pp):
    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.formats.hf import HFSource
    counted = _counting_reads(HFSource)
    cfg = validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp},
                    "model": {"name_or_path": str(model_dir), "init": "pretrained"},
                    "train": {"global_batch_size": 4, "micro_batch_size": 1}})
    engine = MegatronEngine(build_plan(cfg, [world]))
    local = sum(p.numel() for p in engine.parameters())
    per, vocab = engine.lay.padded_vocab // tp, engine.hf_config.vocab_size  # padding rows: zeros, never read
    padding = (per - max(0, min(vocab, (engine.tp_rank + 1) * per) - engine.tp_rank * per)) * engine.hf_config.hidden_size
    return {"read": counted["elements"], "local": local, "padding": padding}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_megatron_ranks_read_only_their_slices(tmp_path, tp, pp):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    total = sum(p.numel() for p in model.parameters())
    for r in run_ranks(_megatron_rank, 2, tmp_path, tmp_path / "model", tp, pp):
        stage_embeddings = 2 if pp == 1 else 1  # an untied model: the embedding and the output layer
        assert r["local"] - stage_embeddings * r["padding"] <= r["read"] <= r["local"]
        assert r["read"] < 0.62 * total  # a share, not the model


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("zero.stage=3",), ("backend=megatron", "megatron.tp=2")])
def test_streamed_exports_equal_the_checkpoint(tmp_path, data_cache, layout):
    """hf_final/ of a ZeRO-3 and of a megatron TP2 run, written tensor by tensor while the ranks
    hold only their shards, equals the converter's HF output of the same step's checkpoint (read
    back from the engine's own files) tensor for tensor, and HF loads it in fp32."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.helpers.runs import run_in_process, train
    run = tmp_path / "run"
    train(run, data_cache, *layout, "train.steps=2", "checkpoint.every=2")
    run_in_process(["convert", str(run / "checkpoints" / "step_00000002"), str(tmp_path / "converted"), "--to", "hf"])
    exported = load_file(str(run / "hf_final" / "model.safetensors"))
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert sorted(exported) == sorted(converted) and all(t.dtype == torch.float32 for t in exported.values())
    for name, tensor in exported.items():
        assert torch.equal(tensor, converted[name]), name
    loaded = AutoModelForCausalLM.from_pretrained(str(run / "hf_final"))
    assert loaded.dtype == torch.float32 and json.loads((run / "hf_final" / "config.json").read_text())["dtype"] == "float32"
    for name, tensor in loaded.state_dict().items():
        if name in exported:
            assert torch.equal(tensor, exported[name]), name
