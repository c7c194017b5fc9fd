"""The offline reference (``toolkit/train/reference.py``: the engine scores every row once before
training, cached on disk) equals an online reference model's log-probabilities exactly: transformers'
model loaded from the same base beside the engine, run on the same micro-batches, its log-softmax
taken whole (not the toolkit's chunked kernel). On ZeRO-1 with two DP ranks (each scores its share),
and with LoRA (the reference is the base: adapters off, as TRL + peft score it). The trainer's eval before
any step attaches each rank's own rows' scores: the policy is the reference, every pair's loss ln 2."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers.dpo import held_models, write_preference_data
from tests.helpers.ranks import run_ranks
from toolkit.loss import IGNORE_INDEX

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

MICRO = 2


def _config(base, data, cache, lora_rank: int):
    from toolkit.config import validate
    return validate({"model": {"name_or_path": str(base), "init": "pretrained"}, "zero": {"stage": 1},
                     "data": {"path": str(data), "format": "json", "template": "preference", "seq_len": 128,
                              "cache_dir": str(cache), "eval_fraction": 0.4},  # two eval micro-batches per rank
                     "train": {"objective": "dpo", "global_batch_size": 4, "micro_batch_size": MICRO},
                     "lora": {"rank": lora_rank}})


def _online(base, micro_batches, width: int) -> np.ndarray:
    """The online reference: the HF model on the micro-batches, per-document sums of the answers'
    log-probabilities (whole-tensor log-softmax)."""
    from transformers import AutoModelForCausalLM

    from toolkit import device
    from toolkit.adapters.hf_attention import forward_inputs, use_document_attention
    from toolkit.objectives import document_sums
    model = use_document_attention(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)).eval()
    out = []
    with torch.no_grad():
        for mb in map(device.to_device, micro_batches):
            logits = model(**forward_inputs(mb)).logits
            valid = mb["labels"] != IGNORE_INDEX
            logps = torch.log_softmax(logits.float(), -1).gather(-1, mb["labels"].clamp(min=0).unsqueeze(-1))
            out.append(document_sums(logps.squeeze(-1) * valid, mb["document_ids"], width))
    return torch.cat(out).cpu().numpy()


def _scores(rank, world, base, data, cache, run_dir, lora_rank):
    import torch.distributed as dist

    from toolkit.adapters.deepspeed import build_engine
    from toolkit.data import load_tokenizer, prepare_data, rank_micro_batches
    from toolkit.plan import build_plan
    from toolkit.train.reference import prepare_reference
    cfg = _config(base, data, cache, lora_rank)
    packed = prepare_data(cfg, load_tokenizer(cfg))
    engine = build_engine(build_plan(cfg, [world]), run_dir, rank)
    ref = prepare_reference(cfg, engine, packed, log=lambda line: None)
    dist.barrier()
    again = prepare_reference(cfg, engine, packed, log=lambda line: None)  # the cache, read back
    rows = len(packed.train) // (world * MICRO) * MICRO  # this rank's whole micro-batches, as scoring cut them
    padded = -(-len(packed.train) // (world * MICRO)) * world * MICRO
    mine = rank_micro_batches(packed.train, list(range(len(packed.train))) + [0] * (padded - len(packed.train)),
                              rank, world, MICRO)
    first = rank * padded // world
    return {"width": ref.width, "key": ref.key, "offline": ref.scores["train"][first:first + rows],
            "cached": again.scores["train"][first:first + rows], "online": _online(base, mine, ref.width)[:rows],
            "eval_at_start": _eval_at_start(cfg, engine, packed, ref, run_dir)}


def _eval_at_start(cfg, engine, packed, ref, run_dir) -> dict:
    """The trainer's eval before any step (each DP rank its rows, with those rows' reference scores): the
    policy is the reference, so every pair's loss is -log(sigmoid(0)) = ln 2."""
    from toolkit.plan import build_plan
    from toolkit.train.trainer import Trainer
    trainer = Trainer(build_plan(cfg, [engine.dp_size]), engine, packed, None, run_dir)
    trainer.reference = ref
    loss = trainer.evaluate()
    return {"loss": loss, "rows": len(packed.eval)}


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_offline_reference_equals_the_online_model_exactly(lora_rank, demo_base, tmp_path):
    data = write_preference_data(tmp_path / "pairs.jsonl", n=60)
    (tmp_path / "run").mkdir()
    results = run_ranks(_scores, 2, tmp_path, str(demo_base), str(data), str(tmp_path / "cache"),
                        str(tmp_path / "run"), lora_rank)
    for r in results:
        assert r["width"] >= 4 and r["key"] == results[0]["key"]
        assert r["eval_at_start"]["rows"] >= 4 * MICRO  # two micro-batches per rank at least
        assert r["eval_at_start"]["loss"] == pytest.approx(math.log(2), abs=1e-6), r["eval_at_start"]
        assert np.array_equal(r["offline"], r["cached"])
        gap = np.abs(r["offline"] - r["online"]).max()
        print(f"\nlora rank {lora_rank}: max |offline - online| {gap:.1e}")
        assert np.array_equal(r["offline"], r["online"])


def _held(rank, world, base, data, cache, run_dir, objective):
    from toolkit.adapters.deepspeed import build_engine
    from toolkit.config import validate
    from toolkit.data import load_tokenizer, prepare_data
    from toolkit.plan import build_plan
    from toolkit.train.reference import prepare_reference
    if objective == "dpo":
        cfg = _config(base, data, cache, 0)
    else:
        cfg = validate({"model": {"name_or_path": str(base), "init": "pretrained"}, "zero": {"stage": 1},
                        "data": {"seq_len": 128},
                        "train": {"global_batch_size": 4, "micro_batch_size": MICRO}})
    engine = build_engine(build_plan(cfg, [world]), run_dir, rank)
    if objective == "dpo":  # the reference pass a DPO run makes before training
        ref = prepare_reference(cfg, engine, prepare_data(cfg, load_tokenizer(cfg)), log=lambda line: None)
        assert ref.scores["train"].size
    return held_models(engine)


def test_a_dpo_run_holds_one_model_as_supervised_fine_tuning_does(demo_base, tmp_path):
    """After its reference pass a DPO engine holds what a supervised one holds: one transformers model,
    the same parameter bytes, no other live parameters (no reference model kept)."""
    data = write_preference_data(tmp_path / "pairs.jsonl", n=20)
    held = {}
    for objective in ("sft", "dpo"):
        (tmp_path / objective).mkdir()
        held[objective] = run_ranks(_held, 1, tmp_path / objective, str(demo_base), str(data),
                                    str(tmp_path / "cache"), str(tmp_path / objective), objective)[0]
    print(f"\n{held}")
    assert held["dpo"] == held["sft"]
    assert held["dpo"]["models"] == 1
