"""Megatron vs HF's own model: the seeded batches, HF's single-process reference, and the per-parameter
gap measures and tolerances the parity tests share."""
from __future__ import annotations

import torch

from toolkit.engine import IGNORE_INDEX, token_loss_sum

LOGIT_TOL = 2e-6  # float32 rounding of other matmul shapes and reduction orders: measured 2.7e-7 (MoE 3.0e-7)
GRAD_RTOL = 2e-5  # measured worst 5.1e-6 (qwen2 q_proj.weight at TP2); 1e-6 for the other families
"""Per parameter: max |megatron - HF| <= GRAD_RTOL x max |HF| of that parameter's own gradient.
(A flat 2e-5 let a 40% error through in small gradients such as qwen2's q_proj.bias.)"""


def batches(vocab: int, n_micro: int = 4, mbs: int = 1, seq: int = 16, seed: int = 3):
    """A global batch of 4 samples in micro-batches of 1, split over the DP ranks."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        ids = torch.randint(0, vocab, (mbs, seq), generator=g)
        labels = torch.randint(0, vocab, (mbs, seq), generator=g)
        labels[0, :3] = IGNORE_INDEX  # some positions carry no loss
        ids[:, 5] = 0  # the pad token of the llama-like configs: HF's padding_idx gets no lookup grad
        out.append({"input_ids": ids, "labels": labels})
    return out


def hf_reference(model, micro_batches):
    """HF logits per micro-batch and HF grads of sum(token losses) / valid tokens, single process."""
    model.zero_grad()
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    logits = []
    for mb in micro_batches:
        out = model(input_ids=mb["input_ids"]).logits
        loss, _ = token_loss_sum(out, mb["labels"])
        (loss / tokens).backward()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits, grads, tokens


def logit_gaps(engine, got, ref_logits) -> dict[int, float]:
    """{this DP rank: max |logit difference| over its micro-batches} where this rank holds logits
    (the last stage's TP rank 0 of each DP replica), else {}."""
    if got is None:
        return {}
    mine = ref_logits[engine.dp_rank::engine.dp_size]
    assert len(got) == len(mine)
    return {engine.dp_rank: max((a - b).abs().max().item() for a, b in zip(got, mine))}


def grad_gap(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, max |ref|) of one parameter's gradient."""
    return (got - ref).abs().max().item(), ref.abs().max().item()


def grad_mismatches(grads: dict[str, tuple[float, float]], rtol: float) -> dict[str, tuple[float, float]]:
    """Parameters whose gradient differs by more than ``rtol`` of its own largest entry."""
    return {n: (diff, scale) for n, (diff, scale) in grads.items() if diff > rtol * scale}


def worst_ratio(grads: dict[str, tuple[float, float]]) -> tuple[float, str]:
    return max((diff / scale if scale else float(diff > 0), n) for n, (diff, scale) in grads.items())


def assert_logits_on_every_dp_rank(d: dict) -> None:
    assert sorted(d["logits"]) == list(range(d["dp"])), f"logits from DP ranks {sorted(d['logits'])} of {d['dp']}"
    bad = {r: gap for r, gap in d["logits"].items() if not gap < LOGIT_TOL}
    assert not bad, bad
