"""Context parallelism (``megatron.cp``) for the toolkit's core attention: each sequence split over
the cp ranks of megatron's context-parallel group, attention computed per head group over the whole
sequence after an all-to-all (DeepSpeed Ulysses' exchange), then exchanged back.

Where each rank's tokens come from: megatron-core's own layout (``megatron.core.utils.
get_batch_on_this_cp_rank``): a row of ``s`` tokens is cut into ``2 x cp`` equal chunks and CP rank
r holds chunks r and 2cp-1-r, so every rank has as many early (cheap under a causal mask) as late
tokens. Everything outside attention (embedding, norms, MLP, output layer, loss) runs on those
``s / cp`` tokens; megatron's DDP sums the weights' gradients over dp x cp.

Inside attention (``to_heads`` / ``to_sequence``), ``[s / cp, b, heads, d]`` ->
``[s, b, heads / cp, d]`` (sequence gathered in the natural token order, heads scattered) and
back: the attention then sees whole rows, so RoPE at each token's position, document masks and
sliding windows are the ones of ``TokenLayout`` for the whole rows (``ContextLayout``: the engine
passes the layout of the whole micro-batch), and plain causal rows keep sdpa's ``is_causal`` kernel.
KV heads (``groups`` per TP rank) fewer than, or not a multiple of, cp are repeated to
``lcm(groups, cp)`` first: query head i still reads its own group's keys (each copy sits next to
the original), and the copies' gradients add up in the repeat's backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.adapters.attention import TokenLayout
from toolkit.layout import kv_copies


@dataclass(eq=False)
class ContextLayout(TokenLayout):
    """``TokenLayout`` of the whole rows ``[b, s]`` for ranks that each hold ``s / cp`` of every row:
    the attention's masks and RoPE read it after the all-to-all; ``group`` is the CP process group."""
    group: object = None


def chunk_order(cp: int) -> list[int]:
    """Chunks (of ``2 x cp``) in the order the CP ranks hold them: rank r holds r and 2cp-1-r."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def rank_slice(batch: dict[str, torch.Tensor | None], group) -> dict[str, torch.Tensor | None]:
    """This CP rank's tokens of each ``[b, s]`` tensor in ``batch`` (megatron-core's own slicer)."""
    from megatron.core.utils import get_batch_on_this_cp_rank
    return get_batch_on_this_cp_rank(dict(batch), cp_group=group)


def chunk_index(cp: int, device, natural: bool = False) -> torch.Tensor:
    """``chunk_order(cp)`` as a tensor on ``device`` (``natural``: its inverse, where each chunk in
    token order sits in the ranks' order), computed there: a tensor from a Python list would be a
    blocking host-to-device copy per layer."""
    i = torch.arange(2 * cp, device=device)
    if natural:  # chunk c < cp is rank c's first; chunk 2cp-1-r is rank r's second
        return torch.where(i < cp, 2 * i, 2 * (2 * cp - 1 - i) + 1)
    return torch.where(i % 2 == 0, i // 2, 2 * cp - 1 - i // 2)


def _reorder(x: torch.Tensor, cp: int, natural: bool) -> torch.Tensor:
    """``x`` ``[s, ...]`` with its ``2 x cp`` chunks along dim 0 in the ranks' order -> token order
    (``natural``), or back."""
    chunks = x.reshape(2 * cp, x.shape[0] // (2 * cp), *x.shape[1:])
    return chunks.index_select(0, chunk_index(cp, x.device, natural)).reshape(x.shape)


def repeat_groups(kv: torch.Tensor, cp: int) -> torch.Tensor:
    """``[s, b, groups, d]`` -> ``[s, b, lcm(groups, cp), d]``, each group repeated in place, so
    the groups divide over cp and head i of ``heads`` still reads group ``i // (heads / groups')``."""
    copies = kv_copies(kv.shape[2], cp)
    return kv if copies == 1 else kv.repeat_interleave(copies, dim=2)


def to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s / cp, b, n, d]`` (this rank's chunks, all ``n`` heads) -> ``[s, b, n / cp, d]`` (the
    whole rows in token order, this rank's ``n / cp`` heads); autograd through megatron's all-to-all."""
    from megatron.core.tensor_parallel.mappings import all_to_all
    cp = group.size()
    s_local, b, n, d = x.shape
    parts = x.reshape(s_local, b, cp, n // cp, d).permute(2, 0, 1, 3, 4)  # [cp (to rank), s/cp, b, n/cp, d]
    gathered = all_to_all(group, parts.contiguous())  # [cp (from rank), s/cp, b, n/cp, d]
    return _reorder(gathered.reshape(cp * s_local, b, n // cp, d), cp, natural=True)


def to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``to_heads``' inverse: ``[s, b, n / cp, d]`` -> ``[s / cp, b, n, d]``."""
    from megatron.core.tensor_parallel.mappings import all_to_all
    cp = group.size()
    s, b, n_local, d = x.shape
    parts = _reorder(x, cp, natural=False).reshape(cp, s // cp, b, n_local, d)  # [cp (to rank), ...]
    back = all_to_all(group, parts.contiguous())  # [cp (head group of rank), s/cp, b, n/cp, d]
    return back.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * n_local, d)


def gather_rows(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The whole rows of ``x`` (this rank's tokens along ``dim``) in token order, on every CP rank;
    no gradient (logits for parity checks)."""
    import torch.distributed as dist
    cp = group.size()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    whole = torch.cat(parts, dim=dim).movedim(dim, 0)
    return _reorder(whole.contiguous(), cp, natural=True).movedim(0, dim)
