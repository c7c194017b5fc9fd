"""``zero.offload_activations`` in one process: the HF model the toolkit builds (``adapters/hf.finish``)
gives the same loss and gradients bit for bit with its checkpointed layer inputs kept by torch's
``save_on_cpu`` (``device.host_checkpoint``), which took one [b, s, h] input per layer and nothing else
(``tests/helpers/offload.py``); the refusals; the estimate moves those inputs to host memory."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.offload import expected_bytes, host_saves
from toolkit.config import ConfigError, validate

RUN = {"model": {"activation_checkpointing": True, "dtype": "bf16"}, "data": {"seq_len": 24},
       "train": {"micro_batch_size": 2, "global_batch_size": 2}}


def _config(offload: bool, **sections):
    raw = {**RUN, "zero": {"offload_activations": offload}, **sections}
    return validate(raw)


def _step(offload: bool):
    from toolkit.adapters.hf import build_model
    from toolkit.plan import build_plan
    cfg = _config(offload)
    plan = build_plan(cfg, [1])
    model = build_model(plan, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with host_saves() as seen:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, seen, expected_bytes(cfg, model.config, micro_batches=1)


def test_offloaded_layer_inputs_give_the_same_step_and_are_what_went_to_the_host():
    loss, grads, seen_off, _ = _step(False)
    loss_on, grads_on, seen, expected = _step(True)
    assert torch.equal(loss_on, loss)
    assert grads_on.keys() == grads.keys() and all(torch.equal(grads_on[n], g) for n, g in grads.items())
    assert seen_off == []
    assert [(shape, dtype) for shape, dtype, _ in seen] == [((2, 24, 128), torch.bfloat16)] * 4  # tiny-llama: 4 layers
    assert sum(b for *_, b in seen) == expected == 4 * 2 * 24 * 128 * 2


@pytest.mark.parametrize("sets, message", [
    ({"model": {"activation_checkpointing": False}},
     "zero.offload_activations=true .* set model.activation_checkpointing=true"),
    ({"backend": "megatron"}, "zero.offload_activations=true .* backend=megatron.* cpu_offloading"),
])
def test_refusals_name_the_key_to_set(sets, message):
    raw = {**RUN, **sets, "zero": {"offload_activations": True}}
    raw["model"] = {**RUN["model"], **sets.get("model", {})}
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_the_estimate_moves_the_checkpointed_inputs_to_host_memory():
    """On: the device's checkpointed activations lose layers x b x s / sp x h x w and the host gains them."""
    from toolkit.estimate.memory import memory
    from toolkit.plan import build_plan
    mems, specs = {}, {}
    for offload in (False, True):
        plan = build_plan(_config(offload, zero={"offload_activations": offload, "sp": 2}), [2])
        mems[offload], specs[offload] = memory(plan.config, plan.model, plan.layout(2)), plan.model
    off, on = mems[False], mems[True]
    inputs = 4 * 2 * (24 // 2) * 128 * 2  # tiny-llama's layers x b x s / sp x hidden x bf16
    assert off.activations - on.activations == off.activations_ckpt - on.activations_ckpt == inputs
    assert on.host - off.host == inputs
    assert on.activations_no_ckpt == off.activations_no_ckpt and on.host_load == off.host_load
