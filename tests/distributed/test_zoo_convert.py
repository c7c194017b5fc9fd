"""The config zoo (``tests/helpers/zoo.py``) through the converter: each variant's HF checkpoint along its
path of the matrix (HF -> ZeRO -> megatron -> HF, or the other way round; every direction between
the three formats is met), every hop ``--verify``-ed, judged by references we did not write: the
last HF directory loads with transformers' ``from_pretrained`` and gives the source's weights and
logits exactly; each megatron hop loads with megatron-core's ``dist_checkpointing`` (through
``MegatronEngine.load``, 2 gloo ranks at the hop's TP x PP) holding exactly the source's weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.zoo import VARIANTS, convert_path, runs, selected

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

PATHS = runs("convert")


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory):
    """variant -> [(format, layout, directory, verify report)] along its path, the HF source first."""
    from toolkit.convert import convert
    from toolkit.convert.verify import verify
    root = tmp_path_factory.mktemp("zoo_convert")
    out = {}
    for variant, setting in selected(request, PATHS).items():
        prev = root / variant / "0-hf"
        VARIANTS[variant].model().save_pretrained(prev)
        hops = [("hf", {}, prev, None)]
        for i, (fmt, layout) in enumerate(convert_path(setting)[1:], 1):
            dst = root / variant / f"{i}-{fmt}"
            convert(prev, dst, to=fmt, **layout)
            hops.append((fmt, layout, dst, verify(prev, dst)))
            prev = dst
        out[variant] = hops
    return out


@pytest.fixture(scope="module")
def megatron_loaded(converted, tmp_path_factory):
    """variant -> the HF weights megatron-core's load of its megatron hop put in the engine (one job)."""
    ckpts = {v: (str(d / "engine"), lay["tp"], lay["pp"]) for v, hops in converted.items()
             for fmt, lay, d, _ in hops if fmt == "megatron"}
    return run_ranks(_megatron_loads, 2, tmp_path_factory.mktemp("zoo_megatron_load"), ckpts, timeout=900)[0]


def _megatron_loads(rank, world, ckpts):
    from tests.helpers.ranks import megatron_engine, release_megatron
    from toolkit.config import validate
    out = {}
    for variant, (ckpt, tp, pp) in ckpts.items():
        model = VARIANTS[variant].model(seed=99)  # another init: everything must come from the checkpoint
        moe_tp = tp > 1 and VARIANTS[variant].family in ("mixtral", "qwen2_moe", "qwen3_moe")
        cfg = validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, "sequence_parallel": moe_tp},
                        "train": {"global_batch_size": 2, "micro_batch_size": 1}})
        engine = megatron_engine(cfg, model)
        engine.load(Path(ckpt))
        out[variant] = engine.hf_state()
        release_megatron()
    return out


@pytest.mark.parametrize("variant", PATHS)
def test_every_hop_verifies_tensors_and_logits(converted, variant):
    for fmt, layout, dst, report in converted[variant][1:]:
        assert report.ok and report.logits_max_diff == 0.0, (fmt, layout, report.lines())
        assert report.tensors == len(_checkpoint_names(variant))


@pytest.mark.parametrize("variant", PATHS)
def test_hf_at_the_end_is_the_source_model_in_transformers(converted, variant):
    from transformers import AutoModelForCausalLM
    source = VARIANTS[variant].model()
    end = converted[variant][-1][2]
    loaded = AutoModelForCausalLM.from_pretrained(end, dtype=torch.float32).eval()
    want, got = source.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    ids = torch.randint(0, source.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, source(input_ids=ids).logits)
    written = json.loads((end / "config.json").read_text())
    for key, value in VARIANTS[variant].changes.items():  # the variant's axes survive the trip
        got_value = written.get(key, written.get("rope_parameters") if key == "rope_scaling" else None)
        if key == "rope_scaling":
            assert {k: got_value[k] for k in value} == value, (key, got_value)
        else:
            assert got_value == value, (key, got_value)


@pytest.mark.parametrize("variant", [v for v, hops in PATHS.items() if "m" in hops])
def test_megatron_core_loads_each_megatron_hop_exactly(converted, megatron_loaded, variant):
    from toolkit.families import find_family, unpack
    model = VARIANTS[variant].model()
    want = unpack(find_family(model.config.model_type), model.config, model.state_dict())  # a tensor per expert
    got = megatron_loaded[variant]
    assert sorted(got) == sorted(want)
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, bad


def test_megatron_hops_refuse_what_the_megatron_table_cannot_honour(converted, tmp_path):
    """The DeepSpeed-only variant (q/k/v/o biases, yarn) converts HF <-> ZeRO; megatron is refused
    before DST exists, naming both fields."""
    from toolkit.convert import ConvertError, convert
    hf = converted["llama-bias-yarn"][0][2]
    with pytest.raises(ConvertError, match=r"(?s)attention_bias=True.*rope scaling type 'yarn'"):
        convert(hf, tmp_path / "meg", to="megatron")
    assert not (tmp_path / "meg").exists()


def _checkpoint_names(variant: str) -> list[str]:
    """The tensors a checkpoint of the variant holds: one per expert (transformers packs them in
    memory), a tied LM head once (HF's state dict lists it twice)."""
    from toolkit.families import find_family, unpack
    model = VARIANTS[variant].model()
    names = list(unpack(find_family(model.config.model_type), model.config, model.state_dict()))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return [n for n in names if not (tied and n == "lm_head.weight")]
