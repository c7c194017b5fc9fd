"""The toolkit's core attention for megatron-core's layer spec: torch's own kernels, RoPE from
per-token positions, document masks, sliding windows and logit softcapping.

megatron-core's local ``DotProductAttention`` materializes the ``[b, heads, s, s]`` scores, refuses
packed documents, and its ``GPTModel`` rotates q and k by *sequence index* (``position_ids`` only
reach learned position embeddings). This module replaces the ``core_attention`` submodule of the
local spec (``model.layer_spec``); it holds no parameters, so checkpoints are unchanged.

Where positions and documents come from: the engine builds a ``TokenLayout`` per micro-batch
(``position_ids`` and optional ``document_ids``, ``[b, s]``, carried with the batch) and passes it to
``GPTModel.forward`` as ``packed_seq_params``, the argument megatron already threads through every
layer, every pipeline stage's forward and its recomputation, down to ``core_attention``. megatron's
own RoPE is switched off (``position_embedding_type="none"``); this module rotates q and k with HF's
frequencies (``AttentionOptions.inv_freq``) at each token's own position, so positions may restart
per document. Learned positions (gpt2) need nothing here: megatron's embedding reads position_ids.

Kernels: ``toolkit/adapters/attention.py`` (shared with the DeepSpeed path's HF models), which
holds ``TokenLayout``, ``attend`` and ``choose_kernel``; ``describe_kernels`` is the line the engine logs.

Context parallelism (``megatron.cp``, ``context.py``): each rank holds ``s / cp`` tokens of every
row; q, k, v go through an all-to-all to ``[s, b, heads / cp, d]`` in token order before RoPE and
``attend``, and the output back; the layout is then the whole rows' (``ContextLayout``).

GQA: K/V keep their ``groups`` heads (sdpa/flex ``enable_gqa``; the math path groups the queries),
never repeated to all heads. With attention dropout sdpa runs torch's math fallback (it still
repeats nothing itself but keeps the probabilities); flex has no dropout and is refused with it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from toolkit.adapters.attention import (  # noqa: F401 - TokenLayout, positions_in_documents: this module's API too
    KERNEL_NOTES,
    TokenLayout,
    attend,
    choose_kernel,
    flex_unavailable,
    masked_note,
    positions_in_documents,
    softcap_score_mod,
)
from toolkit.adapters.megatron import context
from toolkit.config import ConfigError


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """What the module needs beyond megatron's TransformerConfig (the same object for every layer)."""
    mode: str = "auto"
    """megatron.attention: auto | sdpa | flex (``local`` does not build this module)."""
    inv_freq: torch.Tensor | None = None
    """HF's RoPE frequencies ``[head_dim / 2]`` on the rank's device; None: no rotary embedding."""
    softcap: float | None = None
    """Attention logit softcapping: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2)."""
    windows: tuple[int | None, ...] = ()
    """Sliding window (keys at distance < window) per layer, by global layer number - 1; () none."""

    def window(self, layer_number: int) -> int | None:
        return self.windows[layer_number - 1] if self.windows else None


def describe_kernels(mode: str, device_type: str, dtype: str, *, rope: bool, softcap: bool = False,
                     dropout: bool = False) -> str:
    """One line for the run's log: the kernel of plain causal rows and of masked ones (documents or
    windows) on this device, and where positions are applied."""
    if mode == "local":
        return "megatron.attention=local: megatron-core DotProductAttention (s x s scores) and its own RoPE"
    plain, masked = (choose_kernel(mode, device_type, masked=m, softcap=softcap, dropout=dropout,
                                   no_compile=flex_unavailable(device_type)) for m in (False, True))
    return (f"megatron.attention={mode} on {device_type} {dtype}: causal rows -> {plain} ({KERNEL_NOTES[plain]}); "
            f"documents/windows -> {masked} {masked_note(masked, device_type)}; "
            + ("RoPE at per-token positions" if rope else "learned positions from position_ids"))


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE (``x * cos + rotate_half(x) * sin``) on the first ``cos.shape[-1]`` channels of
    ``x`` ``[s, b, heads, d]``; the rest pass through."""
    d = cos.shape[-1]
    x_rot, x_pass = x[..., :d], x[..., d:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    out = x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if x_pass.shape[-1] == 0 else torch.cat([out, x_pass], dim=-1)


# --- the megatron submodule --------------------------------------------------------------------------

@lru_cache(maxsize=1)
def core_attention_class() -> type:
    """megatron's ``core_attention`` submodule class (built lazily: megatron is imported only here)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class CoreAttention(MegatronModule):
        """``[s, b, heads, d]`` q and ``[s, b, groups, d]`` k, v from megatron's SelfAttention ->
        ``[s, b, heads * d]``; RoPE at each token's position, then ``attend``. The constructor takes
        what megatron passes ``DotProductAttention``, plus ``options`` from the spec's params."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type=None, pg_collection=None, options: AttentionOptions = AttentionOptions()):
            super().__init__(config=config)
            if attn_mask_type != AttnMaskType.causal:
                raise ConfigError(f"the toolkit's attention is causal; got {attn_mask_type}")
            self.options, self.layer_number = options, layer_number
            self.window = options.window(layer_number)
            self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self.score_mod = softcap_score_mod(options.softcap)
            # as DotProductAttention: heads differ per TP rank, so dropout draws from the TP-rank stream
            self.dropout_rng = None if config.sequence_parallel else tensor_parallel.get_cuda_rng_tracker

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            layout = _layout_of(packed_seq_params, attention_mask, attention_bias)
            s, b = query.shape[:2]
            group = self._context_group(layout)
            if group is not None:  # [s / cp, b, n, d] -> [s, b, n / cp, d], the whole rows in token order
                key, value = (context.repeat_groups(x, group.size()) for x in (key, value))
                query, key, value = (context.to_heads(x, group) for x in (query, key, value))
            if self.options.inv_freq is not None:
                cos, sin = layout.rotary(self.options.inv_freq, query.dtype)
                query, key = rotate_half(query, cos, sin), rotate_half(key, cos, sin)
            p = self.dropout if self.training else 0.0
            with self.dropout_rng().fork() if p and self.dropout_rng else contextlib.nullcontext():
                out = attend(*(x.permute(1, 2, 0, 3) for x in (query, key, value)), layout, self.options.mode,
                             window=self.window, scale=self.scale, softcap=self.options.softcap, dropout=p,
                             score_mod=self.score_mod)
            out = out.permute(2, 0, 1, 3)
            if group is not None:
                out = context.to_sequence(out, group)
            return out.reshape(s, b, -1)

        def _context_group(self, layout: TokenLayout):
            """The CP group (None without context parallelism); the layout must be the whole rows'."""
            if self.config.context_parallel_size == 1:
                return None
            if not isinstance(layout, context.ContextLayout) or layout.group is None:
                raise TypeError(f"context_parallel_size={self.config.context_parallel_size}: the toolkit's core "
                                "attention needs the whole rows' ContextLayout (with the CP group) as packed_seq_params")
            return layout.group

    return CoreAttention


def _layout_of(packed_seq_params, attention_mask, attention_bias) -> TokenLayout:
    if not isinstance(packed_seq_params, TokenLayout):
        raise TypeError("the toolkit's core attention needs a TokenLayout as GPTModel's packed_seq_params "
                        f"(the megatron engine passes one per micro-batch), got {type(packed_seq_params).__name__}")
    if attention_mask is not None or attention_bias is not None:
        raise ValueError("the toolkit's core attention takes documents from the TokenLayout, not an "
                         "attention_mask / attention_bias")
    return packed_seq_params
