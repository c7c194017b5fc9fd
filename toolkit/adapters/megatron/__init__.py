"""Megatron-core adapter: this rank's GPTModel stage(s) from the run plan, as an Engine.

  model.py    TransformerConfig, the local layer spec (sequence-parallel norms, the toolkit's
              core attention and load-balancing router), GPTModel chunks per virtual stage
  attention.py  the core attention: torch sdpa / flex_attention, RoPE at per-token positions
              (``TokenLayout``, passed as packed_seq_params), document masks, windows, softcap
  experts.py  the grouped experts (``model.experts_implementation``): SequentialMLP's parameters,
              one torch._grouped_mm per projection
  context.py  context parallelism (megatron.cp): each rank's chunks of every row, the attention's
              all-to-all (heads for sequence)
  weights.py  HF weights into the chunks, each TP rank reading only its slices
  grid.py     this rank's place in megatron's process grid: the one reader of its parallel_state
  engine.py   ``MegatronEngine``: process groups, DDP, distributed optimizer, steps, the loss
  state.py    torch_dist checkpoints (fully reshardable optimizer)
  export.py   full tensors gathered to rank 0; ``hf_final/``

Order of what ``MegatronEngine`` applies: process groups (``initialize_model_parallel``: tp, pp,
vpp, ep, cp); model chunks (this stage's layers only); weights; DDP (grads reduced in fp32 buckets) and
the distributed optimizer (Adam, decoupled weight decay); steps with ``get_forward_backward_func``
(no pipelining, 1F1B, or interleaved 1F1B). Version patches live in ``toolkit/compat``.
"""
from __future__ import annotations

from toolkit.adapters.megatron.engine import MegatronEngine, build_engine, check_machine, vocab_parallel_loss_sum

__all__ = ["MegatronEngine", "build_engine", "check_machine", "vocab_parallel_loss_sum"]
