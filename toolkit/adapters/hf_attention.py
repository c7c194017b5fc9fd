"""Document attention for HF models (the DeepSpeed path): packed rows whose documents neither see
each other nor share positions.

transformers dispatches every layer's attention through ``AttentionInterface`` by
``config._attn_implementation``; the toolkit registers ``ATTENTION`` there (``use_document_attention``
switches a model to it). The engine passes, per micro-batch, ``position_ids`` restarting at each
document (RoPE angles or learned-position rows) and the micro-batch's ``TokenLayout`` under the
keyword ``LAYOUT_KWARG``, which transformers threads through the decoder layers to the attention
function untouched (as it does flash-attention's ``cu_seq_lens``). The function runs
``toolkit/adapters/attention.attend`` with the layer's own scale, dropout, sliding window and softcap:

- CPU: sdpa per document span, no ``[b, 1, s, s]`` mask (``math`` with a logit softcap);
- GPU: flex_attention with a document block mask (sdpa with the mask when attention dropout is on).

Boundaries come from the data's ``document_ids``, never from positions. transformers builds no mask
for an implementation it does not know, so a 2D padding mask would be dropped: the function refuses
one, and ``check_applied`` raises after a forward whose layers never consulted the layout (a model
whose attention does not go through ``AttentionInterface``): boundaries are never ignored silently.

A model that caps attention logits or slides a window runs this function on plain rows too (one
causal document per row; ``adapters/hf.finish``): transformers' own implementations differ in
whether they apply either (5.17 gives gemma2 sdpa, which drops the softcap).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from toolkit.adapters.attention import (
    KERNEL_NOTES,
    TokenLayout,
    attend,
    choose_kernel,
    flex_unavailable,
    masked_note,
    softcap_score_mod,
)

ATTENTION = "toolkit_documents"
"""The name under which the toolkit's attention is registered with transformers."""
LAYOUT_KWARG = "toolkit_layout"
"""The forward keyword that carries the micro-batch's ``TokenLayout`` down to the attention."""
_CALLS = "hf_attention_calls"  # TokenLayout memo key: how many layers applied this layout


def document_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: float | None = None, sliding_window: int | None = None,
                       softcap: float | None = None, **kwargs):
    """transformers' attention signature: q ``[b, heads, s, d]``, k/v ``[b, groups, s, d]`` ->
    (``[b, s, heads, d]``, None), causal and confined to each token's document."""
    layout = kwargs.get(LAYOUT_KWARG)
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={ATTENTION!r} takes documents from {LAYOUT_KWARG}, not an "
                         "attention_mask; pass document_ids through the toolkit's data instead")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"attn_implementation={ATTENTION!r} is for training and scoring whole rows (no KV "
                         f"cache): queries {query.shape[2]} != keys {key.shape[2]}; generate with sdpa")
    if layout is None:  # plain rows (a capped or windowed model; a check after training)
        layout = _plain_layout(query.shape[0], query.shape[2], query.device)
    layout._memo[_CALLS] = layout._memo.get(_CALLS, 0) + 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(query, key, value, layout, window=sliding_window or None, scale=scale, softcap=softcap,
                 dropout=dropout, score_mod=_score_mod(softcap))
    # A copy only under zero.sp, and the one DeepSpeed's wrapper would make itself: the kernel's output
    # follows the queries' layout, there [b, heads/sp, s, d] (ulysses_sp.py makes them contiguous), and
    # the wrapper reshapes [b, s, heads/sp, d] to [s, b, heads/sp * d] for its all-to-all, a copy unless
    # token-major (measured: returning the view moved the same bytes into that reshape). HF's own
    # [b, s, heads, d] queries and the CPU's document spans give it token-major: no copy. It also keeps
    # what reaches the wrapper's collective contiguous (NCCL refuses strided tensors).
    return out.transpose(1, 2).contiguous(), None


@lru_cache(maxsize=4)
def _plain_layout(b: int, s: int, where: torch.device) -> TokenLayout:
    """One causal document per row, shared by every layer and forward of this shape (its masks are
    built once, not per layer)."""
    return TokenLayout(torch.arange(s, device=where).expand(b, s))


@lru_cache(maxsize=8)
def _score_mod(softcap: float | None):
    """One flex_attention ``score_mod`` per softcap value: a new closure per call would make the
    compiled kernel recompile at every layer and step."""
    return softcap_score_mod(softcap)


def switch_attention(model: torch.nn.Module, name: str, function, unable: str) -> torch.nn.Module:
    """Register ``function`` with transformers' AttentionInterface as ``name`` and switch ``model``
    (and its sub-models) to it; ``unable`` ends the error when the model does not take it."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, function)  # a dict entry: registering again is harmless
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} did not take attn_implementation={name!r} (its attention "
                           f"does not dispatch through transformers' AttentionInterface): {unable}")
    return model


def use_document_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` (and its sub-models) to the toolkit's document attention."""
    return switch_attention(model, ATTENTION, document_attention,
                            "it cannot train on rows packed by documents: use data.packing=concat")


def forward_inputs(mb: dict) -> dict:
    """The HF forward's inputs of a micro-batch: ``input_ids``; for rows packed by documents also
    ``position_ids`` restarting at each document and the ``TokenLayout`` (``LAYOUT_KWARG``)."""
    if mb.get("document_ids") is None:
        return {"input_ids": mb["input_ids"]}
    layout = TokenLayout.of(mb["input_ids"], document_ids=mb["document_ids"])
    return {"input_ids": mb["input_ids"], "position_ids": layout.position_ids, LAYOUT_KWARG: layout}


def check_applied(inputs: dict) -> None:
    """Raise when a forward given a layout ran without any layer applying it."""
    layout = inputs.get(LAYOUT_KWARG)
    if layout is not None and not layout._memo.get(_CALLS):
        raise RuntimeError("rows packed by documents ran through a model whose attention never received "
                           f"their layout (attn_implementation is not {ATTENTION!r}, or the model does not "
                           "pass attention keywords on): attention would cross documents; use data.packing=concat")


def real_tokens(mb: dict) -> torch.Tensor | None:
    """``[b * s]`` bool: tokens of documents (not the padded tail), in HF's flattened token order;
    None when every token is real (``concat`` rows)."""
    docs = mb.get("document_ids")
    return None if docs is None else (docs > 0).reshape(-1)


def describe(device_type: str, dropout: bool, softcap: bool = False) -> str:
    """The line the DeepSpeed path logs for rows packed by documents on this device."""
    kernel = choose_kernel("auto", device_type, masked=True, softcap=softcap, dropout=dropout,
                           no_compile=flex_unavailable(device_type))
    return (f"HF attention: attn_implementation={ATTENTION} on {device_type}: documents -> {kernel} "
            f"({KERNEL_NOTES[kernel]}) {masked_note(kernel, device_type)}; positions restart per document "
            "(position_ids)")
