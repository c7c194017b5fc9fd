"""LoRA in one room: the adapters a run trains, resolved once in the plan and read by both backends,
their checkpoints and the converter.

  ``spec.py``        ``lora.*`` resolved against the model's module names: ``LoraSpec`` (``plan.lora``)
  ``peft.py``        through peft: its config, names and merge; ``apply_lora`` (the model a DeepSpeed
                     run trains); ``peft_skeleton``, peft's model with no weights; ``draw_adapters``
  ``geometry.py``    megatron: which fused linear carries which projections' adapters, what cannot be
                     adapted, how an adapter splits over TP (shapes only; the linears that run
                     megatron-core are ``adapters/megatron/lora.py``'s)
  ``checkpoint.py``  LoRA checkpoints of either backend as one stream, written at any layout of either
  ``convert.py``     ``toolkit convert`` of adapters: to HF-PEFT, merged onto the base, ``--verify``
  ``files.py``       ``toolkit inspect`` of adapters on disk, without torch (their formats and detection:
                     ``formats/peft.py``, ``lora_zero.py``, ``lora_megatron.py``, lines of the format table)

Backend-specific LoRA stays beside its backend: ``adapters/megatron/lora.py`` (adapted linears,
gathers, sharded checkpoints), ``adapters/deepspeed/lora.py`` (an adapter checkpoint resumed at another
DP size or ZeRO stage).
"""
