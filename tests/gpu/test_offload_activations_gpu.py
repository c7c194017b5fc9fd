"""``zero.offload_activations`` on the GPU (``pytest -m gpu``): the layer inputs that HF's activation
checkpointing keeps leave the device. A bf16 Llama built by the toolkit (``adapters/hf.build_model``,
the DeepSpeed path's model) runs forward + backward on one long row with the option off and on:
the activations' peak (``torch.cuda.max_memory_allocated`` above the weights and gradients) falls
by at least 80% of (layers - 1) layer inputs (one comes back for its layer's recompute), what went
to the host is exactly one [1, seq, hidden] bf16 input per layer, and the loss is the same.
``TOOLKIT_GPU_TESTS_ON_CPU=1`` rehearses it on a tiny model (no device memory to measure there)."""
from __future__ import annotations

import json
import time

import torch

from tests.helpers.gpu import DEVICE, GPU_ONLY, REHEARSAL
from tests.helpers.measure import measure
from tests.helpers.offload import expected_bytes, host_saves

pytestmark = GPU_ONLY

LAYERS, HIDDEN, SEQ = (2, 64, 256) if REHEARSAL else (12, 1024, 16384)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": HIDDEN,
         "intermediate_size": HIDDEN * 11 // 4, "num_hidden_layers": LAYERS, "num_attention_heads": 8,
         "num_key_value_heads": 8, "max_position_embeddings": SEQ, "tie_word_embeddings": False}


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _step(model, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item()


def _measured(model_dir, offload: bool) -> dict:
    """A warm-up step (gradients allocated), then one measured step: its loss, seconds, the peak above
    what was allocated before it, and what ``save_on_cpu`` took."""
    from toolkit.adapters.hf import build_model
    from toolkit.config import validate
    from toolkit.plan import build_plan
    cfg = validate({"model": {"name_or_path": str(model_dir), "activation_checkpointing": True, "dtype": "bf16"},
                    "data": {"seq_len": SEQ}, "train": {"micro_batch_size": 1, "global_batch_size": 1},
                    "zero": {"offload_activations": offload}})
    model = build_model(build_plan(cfg, [1]), torch.bfloat16, DEVICE)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    _step(model, ids)
    _sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    start = time.perf_counter()
    with host_saves() as seen:
        loss = _step(model, ids)
    _sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if DEVICE == "cuda" else None
    expected = expected_bytes(cfg, model.config, micro_batches=1)
    del model
    return {"loss": loss, "seconds": seconds, "peak": peak, "saved": seen, "expected": expected}


def test_offloaded_layer_inputs_leave_the_device(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    off, on = _measured(tmp_path, False), _measured(tmp_path, True)
    layer_input = SEQ * HIDDEN * 2  # one [1, seq, hidden] bf16 input
    assert off["saved"] == [] and sum(b for *_, b in on["saved"]) == on["expected"] == LAYERS * layer_input
    measure("loss off / on", [off["loss"], on["loss"]])
    measure("step seconds off / on", [round(off["seconds"], 3), round(on["seconds"], 3)])
    assert on["loss"] == off["loss"]
    if DEVICE != "cuda":
        return
    saved = off["peak"] - on["peak"]
    bound = 0.8 * (LAYERS - 1) * layer_input
    measure("activation peak MiB off / on", [round(off["peak"] / 2**20), round(on["peak"] / 2**20)])
    measure("device bytes saved", saved, bound)
    assert saved >= bound, (off["peak"], on["peak"])
