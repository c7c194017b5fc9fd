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
documents and/or        flex_attention with a block mask      sdpa per document span (``_by_spans``:
sliding window          (sdpa + boolean mask with dropout)    causal, no mask; a window: a view of
                                                              one band mask per micro-batch)
logit softcap           flex_attention ``score_mod``          ``math``: masked softmax in torch ops,
                                                              per document span (flex_attention has
                                                              no CPU backward)
======================  ====================================  =====================================

flex_attention is compiled on GPUs (Triton: a C compiler and Python headers). Where
``compiled.compile_failure`` finds torch.compile broken, the GPU takes the CPU's column (sdpa with a
boolean mask; math with a softcap). The block mask is built from the document boundaries
(``block_mask_of``), without the ``[b, 1, s, s]`` mask ``create_block_mask`` evaluates.

Users: megatron's core attention (``adapters/megatron/attention.py``) and the HF models of the
DeepSpeed path (``adapters/hf_attention.py``, registered as an HF attention implementation).
Pure torch: no backend import here.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

from toolkit import device
from toolkit.config import ConfigError

KERNEL_NOTES = {
    "sdpa": "torch scaled_dot_product_attention",
    "flex": "torch flex_attention (compiled, block mask / score_mod)",
    "math": "masked softmax in torch ops (keeps the scores)",
}


def masked_note(kernel: str, device_type: str) -> str:
    """How ``attend`` confines ``kernel`` to documents and windows on ``device_type``, for the run's log."""
    if kernel == "flex":
        return "with a document block mask"
    if device_type == "cpu":
        return "per document span (no [b, 1, s, s] mask; a window: one band mask per micro-batch)"
    return "with a boolean mask [b, 1, s, s]" + (" and the logit softcap" if kernel == "math" else "")


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

    def spans(self) -> list[tuple[int, int, int]]:
        """(row, first token, tokens) of each document of each row, in order (a row without
        ``document_ids`` is one span); read once per micro-batch, for the CPU's attention only.

        The read is made outside torch's function modes: on the CPU it waits for nothing, and
        ``syncs.SyncCounter``, which counts on the CPU what would make a GPU's host wait, would
        count a read no GPU run makes (``attend`` calls this on CPU tensors only)."""
        if "spans" not in self._memo:
            b, s = self.position_ids.shape
            if self.document_ids is None:
                self._memo["spans"] = [(row, 0, s) for row in range(b)]
            else:
                if self.document_ids.device.type != "cpu":
                    raise ValueError("TokenLayout.spans reads document boundaries on the CPU only")
                with torch._C.DisableTorchFunction():  # [[row, token], ...] in order
                    starts = _document_starts(self.document_ids).nonzero().tolist()
                ends = starts[1:] + [[b, 0]]
                self._memo["spans"] = [(r, t, (s if r2 != r else t2) - t) for (r, t), (r2, t2) in zip(starts, ends)]
        return self._memo["spans"]

    def band(self, window: int | None, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, n, n]``: key k visible to query q iff 0 <= q - k (< window), as a view of one mask per
        micro-batch, window and dtype, sized for its longest span: bool (the math path) or additive
        float (0 / -inf: what sdpa takes without converting, so each layer saves a view of it, not a
        copy of its own)."""
        key = ("band", window, dtype)
        if key not in self._memo:
            idx = torch.arange(max(n for _, _, n in self.spans()), device=self.position_ids.device)
            distance = idx[:, None] - idx[None, :]
            visible = (distance >= 0) if window is None else (distance >= 0) & (distance < window)
            self._memo[key] = (visible if dtype == torch.bool else
                               torch.zeros(visible.shape, dtype=dtype, device=visible.device)
                               .masked_fill_(~visible, float("-inf")))[None, None]
        return self._memo[key][..., :n, :n]

    def block_mask(self, window: int | None):
        """flex_attention's ``BlockMask`` of the same rule as ``allowed``, built from the document
        boundaries (``block_mask_of``): no ``[b, 1, s, s]`` tensor."""
        key = ("block_mask", window)
        if key not in self._memo:
            self._memo[key] = block_mask_of(self.document_ids, self.position_ids.shape[1], window,
                                            self.position_ids.device)
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


# --- flex_attention's block mask, from document boundaries ----------------------------------------

FLEX_BLOCK = 128
"""flex_attention's default tile (queries and keys) of a ``BlockMask``."""


def visibility(document_ids: torch.Tensor | None, window: int | None):
    """flex_attention's ``mask_mod`` of ``TokenLayout.allowed``'s rule (k <= q, same document,
    q - k < window)."""
    def visible(b, h, q, k):
        ok = q >= k
        if window is not None:
            ok = ok & (q - k < window)
        if document_ids is not None:
            ok = ok & (document_ids[b, q] == document_ids[b, k])
        return ok
    return visible


def block_mask_of(document_ids: torch.Tensor | None, s: int, window: int | None, where: torch.device):
    """The ``BlockMask`` of ``visibility`` over ``[b or 1, 1, s, s]``, as ``create_block_mask``
    would build it (partial and full tiles, same indices), computed per tile pair from where each
    query's visible keys begin, O(b * s + b * (s / 128)^2) memory: ``create_block_mask`` evaluates
    the mask at every (query, key) of every row, a ``[b, 1, s, s]`` tensor per micro-batch.

    Query q sees exactly the keys ``first[q] .. q``, ``first[q] = max(start of q's document,
    q - window + 1)``, and ``first`` never decreases along a row (documents are runs). So a tile of
    queries ``[qs, qe]`` sees a tile of keys ``[ks, ke]`` somewhere iff its first query at or past
    ``ks``, q* = max(qs, ks) <= qe, has ``first[q*] <= ke``; and everywhere iff ``ke <= qs`` and
    ``first[qe] <= ks`` (tiles past the end, as ``create_block_mask`` pads them, are never full)."""
    from torch.nn.attention.flex_attention import BlockMask
    idx = torch.arange(s, device=where)
    if document_ids is None:
        first = torch.zeros(1, s, dtype=torch.long, device=where)
    else:
        first = torch.where(_document_starts(document_ids), idx, torch.zeros_like(idx)).cummax(dim=1).values
    if window is not None:
        first = torch.maximum(first, idx - (window - 1))
    tiles = -(-s // FLEX_BLOCK)
    start = torch.arange(tiles, device=where) * FLEX_BLOCK
    end = torch.clamp(start + FLEX_BLOCK - 1, max=s - 1)
    q_star = torch.maximum(start[:, None], start[None, :])  # [query tile, key tile]
    reach = first[:, torch.clamp(q_star, max=s - 1)]  # [b, query tile, key tile]
    some = (q_star <= end[:, None]) & (reach <= end[None, :])
    whole = start + FLEX_BLOCK <= s
    full = (end[None, :] <= start[:, None]) & (first[:, end][:, :, None] <= start[None, None, :]) \
        & whole[:, None] & whole[None, :]
    partial = some & ~full
    counts = [m.sum(-1, dtype=torch.int32)[:, None] for m in (partial, full)]  # [b, 1, query tile]
    order = [torch.argsort(m.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)[:, None]
             for m in (partial, full)]  # the tiles of each kind first, ascending: create_block_mask's order
    return BlockMask.from_kv_blocks(counts[0], order[0], counts[1], order[1], BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=visibility(document_ids, window), seq_lengths=(s, s))


# --- options and kernel choice ---------------------------------------------------------------------

def choose_kernel(mode: str, device_type: str, *, masked: bool, softcap: bool, dropout: bool,
                  grad: bool = True, no_compile: str | None = None) -> str:
    """``sdpa``, ``flex`` or ``math`` for one call (the table in the module docstring).
    ``no_compile``: why compiled flex_attention cannot run here (``flex_unavailable``), or None."""
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
        if no_compile:
            raise ConfigError(f"megatron.attention=flex needs torch.compile, which fails here ({no_compile}); "
                              "install a C compiler and Python headers (Triton builds with them), or use "
                              "megatron.attention=auto (sdpa with a boolean mask, math with a softcap)")
        return "flex"
    if mode != "auto":
        raise ConfigError(f"megatron.attention={mode!r}: expected auto, sdpa or flex here")
    flex_ok = device_type == "cuda" and not dropout and not no_compile
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
                           grad=torch.is_grad_enabled() and q.requires_grad, no_compile=flex_unavailable(q.device.type))
    if kernel == "flex":
        return _flex(q, k, v, layout.block_mask(window), scale, score_mod or softcap_score_mod(softcap))
    if q.device.type == "cpu" and (masked or kernel == "math"):
        return _by_spans(kernel, q, k, v, layout, window, scale, softcap, dropout)
    mask = layout.allowed(window) if masked else None
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    return _math(q, k, v, mask if mask is not None else layout.allowed(None), scale, softcap, dropout)


def flex_unavailable(device_type: str) -> str | None:
    """Why compiled flex_attention cannot run on ``device_type`` here (``compiled.compile_failure``),
    or None. The CPU runs flex_attention uncompiled (forward only); a device this machine lacks is
    described as a working install would run it."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    from toolkit.adapters.compiled import compile_failure
    return compile_failure("cuda")


def _flex(q, k, v, block_mask, scale: float, score_mod):
    from torch.nn.attention.flex_attention import flex_attention
    for name, t in (("query", q), ("key", k), ("value", v)):  # strict mode does not look inside compiled code
        device.require_on_device(t, f"flex_attention's {name}")
    fn = compiled_flex() if q.device.type == "cuda" else flex_attention  # CPU: forward only
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)


RECOMPILE_LIMIT = 64
"""dynamo's recompile limit while compiled flex_attention runs (torch's default: 8). Each shape,
dtype, window and softcap is a kernel of its own (``dynamic=False``): sliding and full layers,
an eval batch, a last short batch."""


@lru_cache(maxsize=1)
def compiled_flex():
    """flex_attention compiled once per process (uncompiled it materializes the scores), under
    ``RECOMPILE_LIMIT``; every kernel after the first is printed (a recompile per micro-batch would
    be slow: TORCH_LOGS=recompiles says why it happened). ``.kernels()``: how many it compiled."""
    from torch.nn.attention.flex_attention import flex_attention
    compiled = _compile_with_limit(flex_attention)
    entry_list = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", lambda fn: ())  # private
    seen = {"entries": 0, "kernels": 0}  # dynamo's cache entries on flex_attention's code: its kernels

    def run(q, k, v, **kwargs):
        out = compiled(q, k, v, **kwargs)
        entries = len(entry_list(flex_attention))
        if entries > seen["entries"]:
            seen["kernels"] += entries - seen["entries"]
            if seen["kernels"] > 1:
                print(f"compiled flex_attention: kernel {seen['kernels']} (of at most {RECOMPILE_LIMIT}) for "
                      f"query {list(q.shape)} {q.dtype}; TORCH_LOGS=recompiles says what changed", flush=True)
        seen["entries"] = entries  # fewer after torch._dynamo.reset()
        return out
    run.kernels = lambda: seen["kernels"]
    return run


def _compile_with_limit(fn):
    """``torch.compile(fn)`` whose recompile limit is ``RECOMPILE_LIMIT``: its own where torch.compile
    takes one (2.13), else dynamo's process-wide limit raised to it (a per-call ``config.patch``
    costs ~100 us, per layer)."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, dynamic=False, recompile_limit=RECOMPILE_LIMIT)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


# --- CPU: one document span at a time --------------------------------------------------------------

def _by_spans(kernel: str, q, k, v, layout: TokenLayout, window: int | None, scale: float, softcap: float | None,
              dropout: float) -> torch.Tensor:
    """``attend`` on CPU, document by document: each span (``TokenLayout.spans``) runs alone, causal
    (a span no longer than the window needs no mask at all). Why: sdpa turns a boolean mask into an fp32
    ``[b, 1, s, s]`` tensor per call and saves it for backward, so every layer kept one (1 GiB per layer
    at 16k tokens) beside the memoized boolean mask (256 MiB); the math path keeps ``s x s`` scores.
    Per span there is no mask, or (window shorter than the span) a view of one band mask per
    micro-batch in the kernel's own form (``TokenLayout.band``: what sdpa saves is that view, shared
    by every layer), and scores of a span's size only. Exact: a document attends only to itself.

    The spans' outputs (each ``[1, heads, n, d]``) are joined token-major into ``[b, s, heads, d]``,
    the layout transformers and megatron read next, returned as ``[b, heads, s, d]``; a micro-batch
    of one span per row (plain rows) runs as one call, its output as the kernel makes it."""
    spans = layout.spans()
    b, s = q.shape[0], q.shape[2]
    if len(spans) == b and all(n == s for _, _, n in spans):
        spans = [(slice(None), 0, s)]  # one document per row: all rows in one call
    parts = []
    for row, start, n in spans:
        windowed = window if window is not None and n > window else None  # else the span is all causal
        rows = row if isinstance(row, slice) else slice(row, row + 1)
        qs, ks, vs = (x[rows, :, start:start + n] for x in (q, k, v))
        if kernel == "sdpa":
            band = layout.band(windowed, n, q.dtype) if windowed else None
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, dropout_p=dropout,
                                                        is_causal=band is None, scale=scale, enable_gqa=True))
        else:
            parts.append(_math(qs, ks, vs, layout.band(windowed, n, torch.bool), scale, softcap, dropout))
    if len(parts) == 1:
        return parts[0]
    joined = torch.cat([p.transpose(1, 2) for p in parts], dim=1)  # [1, b * s, heads, d], rows in order
    return joined.view(b, s, *joined.shape[2:]).transpose(1, 2)


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
