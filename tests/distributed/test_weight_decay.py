"""Which parameters are decayed, on both backends, against the README's rule: "AdamW (matrices
decayed; biases and norms not)". Read from the optimizers the engines really step: DeepSpeed's
param groups, and megatron's distributed optimizer groups after a train_step (the toolkit sets
each group's decay there from megatron's wd_mult). Once missed: norms decayed on the megatron path
only moved losses by 6.8e-6, inside the backend-parity tolerance of the day."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import batches
from tests.helpers.ranks import run_ranks
from toolkit.config import validate
from toolkit.families.tiny import tiny_model
from toolkit.loss import IGNORE_INDEX

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

FAMILIES = ("qwen2", "gpt2")  # q/k/v biases and RMSNorm; biases everywhere, LayerNorm with bias
WEIGHT_DECAY = 0.1


def expected_decay(shape: torch.Size) -> float:
    """The README's rule: matrices (embeddings and the output layer included) decay; 1-D biases and
    norm weights do not."""
    return WEIGHT_DECAY if len(shape) >= 2 else 0.0


def _config(backend: str) -> dict:
    zero = {"zero": {"stage": 0}} if backend == "deepspeed" else {}  # the other backend's keys are refused
    return validate({"backend": backend, **zero,
                     "train": {"global_batch_size": 2, "micro_batch_size": 1, "weight_decay": WEIGHT_DECAY}})


def _deepspeed_decay(family: str) -> dict[str, tuple[float, torch.Size]]:
    from toolkit.adapters.deepspeed import DeepSpeedEngine
    from toolkit.plan import build_plan
    model = tiny_model(family)
    engine = DeepSpeedEngine(build_plan(_config("deepspeed"), [1], hf_config=model.config), model)
    decay_of = {id(p): g["weight_decay"] for g in engine.engine.optimizer.param_groups for p in g["params"]}
    out = {n: (decay_of[id(p)], p.shape) for n, p in engine.module.named_parameters()}
    engine.engine.destroy()
    return out


def _megatron_decay(family: str) -> dict[str, tuple[float, torch.Size]]:
    from tests.helpers.ranks import megatron_engine, release_megatron
    model = tiny_model(family)
    engine = megatron_engine(_config("megatron"), model)
    micro = batches(model.config.vocab_size, n_micro=2)
    engine.train_step(micro, sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro), lr=1e-3)
    out = {}
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for chunk in engine.model:
            for name, p in chunk.module.named_parameters():
                if p in opt.model_param_group_index_map:
                    group, _ = opt.model_param_group_index_map[p]
                    out[name] = (opt.optimizer.param_groups[group]["weight_decay"], p.shape)
    release_megatron()
    return out


def _applied_decay(rank, world):
    """DeepSpeed first: megatron's CPU layer stays on for the rest of the process."""
    deepspeed = {f: _deepspeed_decay(f) for f in FAMILIES}
    return {"deepspeed": deepspeed, "megatron": {f: _megatron_decay(f) for f in FAMILIES}}


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    return run_ranks(_applied_decay, 1, tmp_path_factory.mktemp("decay"))[0]


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
@pytest.mark.parametrize("family", FAMILIES)
def test_matrices_decay_biases_and_norms_do_not(applied, backend, family):
    decay = applied[backend][family]
    wrong = {n: (wd, tuple(shape)) for n, (wd, shape) in decay.items() if wd != expected_decay(shape)}
    assert not wrong, wrong
    undecayed = sorted(n for n, (wd, _) in decay.items() if wd == 0.0)
    assert any("bias" in n for n in undecayed) and any("norm" in n or "ln" in n for n in undecayed), undecayed
    assert sum(wd > 0 for wd, _ in decay.values()) > len(undecayed) / 2  # the matrices: most tensors
