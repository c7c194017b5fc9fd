"""DeepSpeed adapter: the HF model (``adapters/hf.py``, shared) under ZeRO from the run plan, as an Engine.

  engine.py     ``DeepSpeedEngine``: ``deepspeed.initialize`` with the plan's DeepSpeed JSON, steps, the
                loss, checkpoints (DeepSpeed's own files), the HF model built per ZeRO stage
  zero3.py      the model built under ``zero.Init``, each rank's partitions filled from the checkpoint
  optimizer.py  DeepSpeed's Adam where its kernel loads, torch's AdamW where it does not
  ulysses.py    Ulysses sequence parallelism (``zero.sp``): the sp groups, the attention, rows split
  tiles.py      sequence tiles of the MLP and the loss (``zero.tiled_mlp``, ``zero.tiled_loss``)
  moe.py        the load-balancing loss from HF's router logits (with ``zero.sp`` too), ZeRO-3 leaves
  lora.py       a LoRA run's adapter-only checkpoint resumed at another DP size or stage
  quant.py      QLoRA's 4-bit base (``model.quantize``) built piece by piece, partitioned so at ZeRO-3
  preload.py    what the launcher's forkserver loads once for every rank (JIT-built ops, lazy imports)

What is not DeepSpeed's stays in ``adapters/``: the HF model and its weights (``hf.py``), the
document attention of HF models (``hf_attention.py``, ``attention.py``), the MoE loss contract
(``moe.py``) and the HF / PEFT export (``export.py``) that the megatron path shares.
"""
from __future__ import annotations

from toolkit.adapters.deepspeed.engine import DeepSpeedEngine, build_engine, build_model, prebuilt_ops

__all__ = ["DeepSpeedEngine", "build_engine", "build_model", "prebuilt_ops"]
