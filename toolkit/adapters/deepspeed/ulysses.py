"""DeepSpeed's Ulysses sequence parallelism (``zero.sp``) for the HF models of the DeepSpeed path.

The world is dp x sp: ranks ``[i * sp, (i + 1) * sp)`` share the rows of DP replica ``i`` (DeepSpeed's
``parallel_state_sp`` groups, passed to ``deepspeed.initialize`` as its ``mpu``: ZeRO then shards over
the whole world and averages gradients over dp). The trainer hands each DP replica its rows as
always; inside the engine each rank of a row's sequence group takes its contiguous slice of every row
(``SequenceSplit.inputs``): tokens ``[r * s / sp, (r + 1) * s / sp)``, with the real positions of those
tokens (restarting per document) and the labels of that slice. Everything outside attention is
per-token and runs on the slice alone.

Attention goes through DeepSpeed's own ``UlyssesSPAttentionHF`` (``ulysses_sp.py``): q, k, v
``[b, heads, s / sp, d]`` are exchanged by all-to-all into ``[b, heads / sp, s, d]`` (whole rows, a
share of the heads), the core attention runs, and a second all-to-all returns each rank its tokens.
Its core attention is the toolkit's (``hf_attention.document_attention``), not the one DeepSpeed's
``register_with_transformers`` wraps, because that one cannot honour the toolkit's rules: it infers
documents from position resets (the toolkit takes them from ``document_ids`` only), drops masks, and
refuses eager, so softcapped models (gemma2) would lose their cap. Here the micro-batch's whole-row
``TokenLayout`` (built from ``document_ids`` before the split) reaches the core attention under
``hf_attention.LAYOUT_KWARG``, and the layer's scale, window and softcap as transformers passes them.

The wrapper is registered with transformers' ``AttentionInterface`` under ``ULYSSES_ATTENTION`` (a name of its
own: the toolkit's ``toolkit_documents`` entry stays the plain function, so an sp=1 model in the same
process is untouched) and finds its ``UlyssesSPAttentionHF`` in the forward's keywords
(``WRAPPER_KWARG``), one per micro-batch size, owned by the engine.

The loss needs nothing new: each rank sums its slice's token losses (``toolkit.loss``), DeepSpeed
sums gradients over the world and divides by dp, and the engine scales by dp / global valid tokens,
so the gradient is that of the mean over the global batch's valid tokens (the loss contract).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.adapters.attention import TokenLayout
from toolkit.adapters.hf_attention import LAYOUT_KWARG, document_attention, switch_attention
from toolkit.layout import Layout, zero_partitions

ULYSSES_ATTENTION = "toolkit_ulysses"
"""The attention implementation name of a sequence-parallel model (``use_ulysses_attention``)."""
WRAPPER_KWARG = "toolkit_ulysses_wrapper"
"""The forward keyword that carries the engine's ``UlyssesSPAttentionHF`` down to the attention."""


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature: DeepSpeed's ``UlyssesSPAttentionHF`` around the toolkit's
    document attention. q ``[b, heads, s / sp, d]``, k/v ``[b, groups, s / sp, d]`` -> ``[b, s / sp,
    heads, d]``."""
    wrapper = kwargs.pop(WRAPPER_KWARG, None)
    if wrapper is None:
        raise RuntimeError(f"attn_implementation={ULYSSES_ATTENTION!r} needs the engine's sequence split: a model switched "
                           "to it runs only inside the DeepSpeed engine of a zero.sp run")
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={ULYSSES_ATTENTION!r} takes documents from {LAYOUT_KWARG}, not an attention_mask")
    return wrapper(module, query, key, value, None, **kwargs)


def use_ulysses_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` to the sequence-parallel attention (before peft wraps it)."""
    return switch_attention(model, ULYSSES_ATTENTION, ulysses_attention, "it cannot run with zero.sp > 1")


def sequence_groups(sp: int):
    """DeepSpeed's sequence-parallel groups (``parallel_state_sp``: consecutive ranks), made once per
    process, as the ``mpu`` ``deepspeed.initialize`` takes; collective."""
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    from toolkit.parallel import comm_backend
    deepspeed.init_distributed(dist_backend=comm_backend())
    if mpu._SEQUENCE_PARALLEL_GROUP is None:  # DeepSpeed keeps them module-global and refuses a second set
        mpu.initialize_sequence_parallel(sequence_parallel_size=sp)
    elif mpu.get_sequence_parallel_world_size() != sp:
        raise RuntimeError(f"this process already has DeepSpeed sequence-parallel groups of size "
                           f"{mpu.get_sequence_parallel_world_size()}, not zero.sp={sp}")
    return mpu


def forget_sequence_groups() -> None:
    """An engine without sequence parallelism after one with it in the same process (tests): DeepSpeed
    keeps the last ``mpu`` module-global (``deepspeed.utils.groups.mpu``) and would divide by its sp."""
    from deepspeed.utils import groups
    if groups.mpu is not None and hasattr(groups.mpu, "initialize_sequence_parallel"):
        groups.mpu = None


class SequenceSplit:
    """This rank's place in the dp x sp world (``lay.place``) and its slice of each micro-batch;
    ``hf_config``: the model's (head counts and sizes for DeepSpeed's wrapper)."""

    def __init__(self, lay: Layout, hf_config):
        sp, place = lay.sp, lay.place(dist.get_rank())
        self.mpu = sequence_groups(sp)
        self.sp, self.sp_rank = sp, self.mpu.get_sequence_parallel_rank()
        if self.sp_rank != place.sp:  # the groups DeepSpeed holds must be the layout's
            raise RuntimeError(f"DeepSpeed's sequence-parallel rank {self.sp_rank} is not the layout's {place.sp} "
                               f"({lay.describe()})")
        self.dp_rank, self.dp_size = place.dp, lay.dp
        self.dp_group = _replica_group(sp)
        self.config = hf_config.get_text_config()
        self._wrappers: dict[int, object] = {}

    def wrapper(self, batch: int):
        """DeepSpeed's ``UlyssesSPAttentionHF`` for micro-batches of ``batch`` rows (its shapes are
        fixed at construction but for the sequence length)."""
        if batch not in self._wrappers:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
            c = self.config
            self._wrappers[batch] = UlyssesSPAttentionHF(
                attn=document_attention, batch_size=batch, attn_head_count=c.num_attention_heads,
                attn_head_size=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                kv_head_count=c.num_key_value_heads, num_hidden_layers=c.num_hidden_layers,
                process_group=self.mpu.get_sequence_parallel_group(), seq_length_is_variable=True)
        return self._wrappers[batch]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a ``[b, s, ...]`` tensor along the sequence, as a contiguous tensor of its
        own: with 2 or more rows the slice is a strided view (and positions without documents an
        expanded arange, stride 0 across rows), which DeepSpeed's wrapper all-gathers every layer and
        NCCL refuses ("Tensors must be contiguous"; gloo copies it)."""
        s = t.shape[1]
        if s % self.sp:
            raise ValueError(f"a micro-batch of {s} tokens per row does not split over zero.sp={self.sp}")
        chunk = s // self.sp
        return t[:, self.sp_rank * chunk:(self.sp_rank + 1) * chunk].contiguous()

    def inputs(self, mb: dict) -> dict:
        """The HF forward's inputs for this rank: its slice of the tokens and of their positions (whole
        rows' positions, restarting per document), the whole rows' ``TokenLayout`` for the core
        attention, and DeepSpeed's wrapper."""
        ids = mb["input_ids"]
        layout = TokenLayout.of(ids, document_ids=mb.get("document_ids"))
        return {"input_ids": self.local(ids), "position_ids": self.local(layout.position_ids),
                LAYOUT_KWARG: layout, WRAPPER_KWARG: self.wrapper(ids.shape[0])}

    def describe(self) -> str:
        return (f"Ulysses sequence parallelism (DeepSpeed's UlyssesSPAttentionHF): sp={self.sp}, this rank's "
                f"tokens are slice {self.sp_rank} of every row; dp={self.dp_size}")


def _replica_group(sp: int):
    """The ranks holding the same slice of different rows (stride sp): this rank's DP replicas, for
    the checks that compare replicas (``watch/monitor.py``); collective."""
    world = dist.get_world_size()
    mine = None
    for first in range(sp):
        ranks = list(range(first, world, sp))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def average_zero3_grads_over_dp(optimizer, sp: int) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 reduce-scatter (``__avg_scatter_grads``, the path its default
    ``reduce_scatter: true`` always takes) averages gradients over every rank of dp x sp, forgetting
    the Ulysses ranks its other paths divide out (``sequence_parallel_size``): measured at sp=2, every
    gradient came out half of HF's. That path rescales by partition ranks / ``_gradient_averaging_
    world_size``; answering dp = partition ranks / sp there makes the average over dp, as at stages
    0-2. The plan keeps ``reduce_scatter`` on for zero.sp at stage 3 (the contiguous path, which
    already divides by sp, never runs then)."""
    if not optimizer.reduce_scatter:
        raise RuntimeError("zero.sp at ZeRO-3 needs zero_optimization.reduce_scatter=true (the plan sets it)")
    own = optimizer._gradient_averaging_world_size

    def over_dp(params, partition_world_size):
        return own(params, partition_world_size) / sp
    optimizer._gradient_averaging_world_size = over_dp


def same_zero_files(saved: dict, ours: dict) -> bool:
    """Whether a DeepSpeed checkpoint of layout record ``saved`` is, file for file, what this engine
    writes: the same ZeRO stage over as many partitions (``zero_partitions``), whatever their split
    into dp x sp, and the same expert parallelism (``zero.ep``: AutoEP's files are per expert and name its
    modules)."""
    rest = ("tp", "pp", "zero_stage")
    return saved.get("dp") is not None and zero_partitions(saved) == zero_partitions(ours) and \
        all(saved.get(k) == ours.get(k) for k in rest) and saved.get("ep", 1) == ours.get("ep", 1)
