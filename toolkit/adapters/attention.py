"""Attention confined to documents, shared by both backends: per-token positions and document ids
of a micro-batch (``TokenLayout``), the masks they imply, and the kernel that applies them.

``TokenLayout`` holds ``position_ids`` and ``document_ids`` ``[b, s]`` as the data carries them
(``toolkit/data``: never guessed from positions); ``attend`` runs causal attention confined to each
token's document (and sliding window) through the kernel ``choose_kernel`` picks:

======================  ====================================  =====================================
need                    GPU (cuda)                            CPU
======================  ====================================  =====================================
causal                  sdpa ``is_causal`` (flash / cuDNN /   sdpa ``is_causal`` (torch's CPU flash
                        memory-efficient, torch picks)        kernel)
documents and/or        flex_attention with a block mask      sdpa with a boolean ``[b, 1, s, s]``
sliding window          (sdpa + boolean mask with dropout)    mask (the CPU flash kernel takes it)
logit softcap           flex_attention ``score_mod``          ``math``: masked softmax in torch ops
                                                              (flex_attention has no CPU backward)
======================  ====================================  =====================================

Users: megatron's core attention (``adapters/megatron/attention.py``) and the HF models of the
DeepSpeed path (``adapters/hf_attention.py``, registered as an HF attention implementation).
Pure torch: no backend import here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

from toolkit import device
from toolkit.config import ConfigError

KERNEL_NOTES = {
    "sdpa": "torch scaled_dot_product_attention",
    "flex": "torch flex_attention (compiled, block mask / score_mod)",
    "math": "masked softmax in torch ops (keeps the s x s scores)",
}


# --- where each token sits -------------------------------------------------------------------------

@dataclass(eq=False)
class TokenLayout:
    """Per-token position and document of one micro-batch: ``position_ids`` ``[b, s]`` (RoPE angle or
    learned-position row; may restart per document) and ``document_ids`` ``[b, s]`` or None (each row
    one document). A new document starts wherever ``document_ids`` changes along a row (stored as run
    numbers, so equal labels of two separate runs never see each other); boundaries are never
    guessed from positions. Methods memoize per micro-batch what every layer shares (cos/sin, masks).

    Passed to megatron's ``GPTModel.forward`` as ``packed_seq_params``: the class attributes below
    are megatron's ``PackedSeqParams`` fields, read only by its ``thd`` and context-parallel paths."""
    position_ids: torch.Tensor
    document_ids: torch.Tensor | None = None
    _memo: dict = field(default_factory=dict, init=False, repr=False)

    qkv_format = "sbhd"
    cu_seqlens_q = cu_seqlens_kv = cu_seqlens_q_padded = cu_seqlens_kv_padded = None
    max_seqlen_q = max_seqlen_kv = local_cp_size = cp_group = None

    def __post_init__(self):
        for name in ("position_ids", "document_ids"):
            t = getattr(self, name)
            if t is None:
                continue
            device.require_on_device(t, name)
            if t.dim() != 2 or t.is_floating_point():
                raise ValueError(f"{name} must be an integer tensor [batch, seq], got {t.dtype} {tuple(t.shape)}")
        if self.document_ids is not None:
            if self.document_ids.shape != self.position_ids.shape:
                raise ValueError(f"document_ids {tuple(self.document_ids.shape)} and position_ids "
                                 f"{tuple(self.position_ids.shape)} differ in shape")
            self.document_ids = _document_starts(self.document_ids).cumsum(dim=1)

    @classmethod
    def of(cls, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
           document_ids: torch.Tensor | None = None) -> "TokenLayout":
        """The layout of a micro-batch with token ids ``ids`` ``[b, s]``: positions as given, else
        restarting at each document (``document_ids``), else 0..s-1 in every row."""
        if position_ids is None:
            position_ids = positions_in_documents(document_ids) if document_ids is not None else \
                torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return cls(position_ids, document_ids)

    @classmethod
    def from_cu_seqlens(cls, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> "TokenLayout":
        """From cumulative document lengths over the flattened micro-batch (``[0, l1, l1 + l2, ...,
        b * s]``, flash-attn's varlen convention); a document does not cross rows."""
        token = torch.arange(ids.numel(), device=ids.device)
        documents = torch.searchsorted(cu_seqlens.to(ids.device), token, right=True).view_as(ids)
        return cls.of(ids, document_ids=documents)

    def rotary(self, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[s, b, 1, 2 * len(inv_freq)]`` at each token's position, as HF computes them
        (angles in fp32, then cast to the activations' dtype)."""
        key = ("rotary", id(inv_freq), dtype)
        if key not in self._memo:
            angles = self.position_ids.t().unsqueeze(-1).float() * inv_freq.float()  # [s, b, d/2]
            emb = torch.cat([angles, angles], dim=-1).unsqueeze(2)
            self._memo[key] = emb.cos().to(dtype), emb.sin().to(dtype)
        return self._memo[key]

    def allowed(self, window: int | None) -> torch.Tensor:
        """``[b or 1, 1, s, s]`` bool: query q may see key k (k <= q, same document, q - k < window)."""
        key = ("allowed", window)
        if key not in self._memo:
            s = self.position_ids.shape[1]
            idx = torch.arange(s, device=self.position_ids.device)
            distance = idx[:, None] - idx[None, :]
            mask = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
            mask = mask[None, None]
            if self.document_ids is not None:
                docs = self.document_ids
                mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
            self._memo[key] = mask
        return self._memo[key]

    def block_mask(self, window: int | None):
        """flex_attention's ``BlockMask`` of the same rule as ``allowed``."""
        key = ("block_mask", window)
        if key not in self._memo:
            from torch.nn.attention.flex_attention import create_block_mask
            docs, s = self.document_ids, self.position_ids.shape[1]

            def visible(b, h, q, k):
                ok = q >= k
                if window is not None:
                    ok = ok & (q - k < window)
                if docs is not None:
                    ok = ok & (docs[b, q] == docs[b, k])
                return ok
            batch = docs.shape[0] if docs is not None else None
            self._memo[key] = create_block_mask(visible, batch, None, s, s, device=self.position_ids.device)
        return self._memo[key]


def _document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: a document starts here (the first token, or the label changed)."""
    first = torch.ones_like(document_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, document_ids[:, 1:] != document_ids[:, :-1]], dim=1)


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` positions that restart at 0 at each document start."""
    idx = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    start = torch.where(_document_starts(document_ids), idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start


# --- options and kernel choice ---------------------------------------------------------------------

def choose_kernel(mode: str, device_type: str, *, masked: bool, softcap: bool, dropout: bool,
                  grad: bool = True) -> str:
    """``sdpa``, ``flex`` or ``math`` for one call (the table in the module docstring)."""
    if mode == "sdpa":
        if softcap:
            raise ConfigError("megatron.attention=sdpa cannot cap attention logits (the model has a logit "
                              "softcap); use megatron.attention=auto or flex")
        return "sdpa"
    if mode == "flex":
        if dropout:
            raise ConfigError("megatron.attention=flex has no attention dropout and the model's attention "
                              "dropout is > 0; use megatron.attention=auto or sdpa, or set the dropout to 0")
        if device_type == "cpu" and grad:
            raise ConfigError("megatron.attention=flex cannot train on CPU (torch's flex_attention has no CPU "
                              "backward); use megatron.attention=auto or sdpa")
        return "flex"
    if mode != "auto":
        raise ConfigError(f"megatron.attention={mode!r}: expected auto, sdpa or flex here")
    flex_ok = device_type == "cuda" and not dropout
    if softcap:
        return "flex" if flex_ok else "math"
    return "flex" if masked and flex_ok else "sdpa"


# --- the computation (pure torch; ``[batch, heads, seq, head_dim]``) --------------------------------

def softcap_score_mod(softcap: float | None):
    """flex_attention's ``score_mod`` for logit softcapping (made once per module: a new closure
    per call would make the compiled kernel recompile)."""
    if softcap is None:
        return None

    def capped(score, b, h, q, k):
        return softcap * torch.tanh(score / softcap)
    return capped


def attend(q, k, v, layout: TokenLayout, mode: str = "auto", *, window: int | None = None, scale: float,
           softcap: float | None = None, dropout: float = 0.0, score_mod=None) -> torch.Tensor:
    """Causal attention ``[b, heads, s, d]`` of q ``[b, heads, s, d]`` over k, v ``[b, groups, s, d]``
    (heads a multiple of groups; head i reads group i // (heads / groups)), confined to each token's
    document and window, through the kernel ``choose_kernel`` picks."""
    masked = layout.document_ids is not None or window is not None
    kernel = choose_kernel(mode, q.device.type, masked=masked, softcap=softcap is not None, dropout=dropout > 0,
                           grad=torch.is_grad_enabled() and q.requires_grad)
    if kernel == "flex":
        return _flex(q, k, v, layout.block_mask(window), scale, score_mod or softcap_score_mod(softcap))
    mask = layout.allowed(window) if masked else None
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    return _math(q, k, v, mask if mask is not None else layout.allowed(None), scale, softcap, dropout)


def _flex(q, k, v, block_mask, scale: float, score_mod):
    from torch.nn.attention.flex_attention import flex_attention
    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention  # CPU: forward only
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)


@lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention compiled once per process (uncompiled it materializes the scores)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _math(q, k, v, mask, scale: float, softcap: float | None, dropout: float) -> torch.Tensor:
    """HF eager's order: scores * scale, softcap, mask, softmax in fp32, dropout, @ v. Queries are
    grouped per KV head (``[b, groups, heads_per_group * s, d]``), so K/V are not repeated."""
    b, h, s, d = q.shape
    g = k.shape[1]
    scores = (q.reshape(b, g, h // g * s, d) @ k.transpose(-1, -2)).view(b, h, s, s) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.dropout(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), dropout)
    return (probs.view(b, g, h // g * s, s) @ v).view(b, h, s, d)
