"""Objectives beyond the token cross-entropy, one home for their math: direct preference optimization
(DPO) as TRL's ``DPOTrainer`` defines it (``sigmoid``, ``ipo``, ``hinge``; TRL's metric names).

Rows of preference pairs (``data.template: preference``) hold whole pairs: in a row, pair j
(1-based) is document ``2j - 1`` (prompt + chosen) and document ``2j`` (prompt + rejected) of its
``document_ids`` (0 = padding), with loss labels on the answers only. The engines give per-token
log-probabilities ``[batch, seq]`` (the HF path: ``loss.token_logps``; megatron: its vocabulary-
parallel cross entropy); here they are summed per document (``DocumentSums``, in fp64), paired, and
turned into pair losses against the reference model's sums (``ref_logps``, ``[batch, width]`` per
document, fp64: ``toolkit/train/reference.py`` scores them once before training).

The loss contract for pairs: an engine's backward starts from ``loss_sum(...)[0] / pairs`` where
``pairs`` counts the whole global batch's pairs, so the gradient is that of the mean pair loss over
the global batch whatever the DP size, micro-batch size or packing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.loss import IGNORE_INDEX, token_logps, token_loss_sum

REF_COLUMN = "ref_logps"
"""The micro-batch column of the reference model's per-document log-probability sums."""
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")
"""TRL's metric names, each a mean over the pairs of the global batch (``DPO.metrics``)."""
STATS = len(DPO_METRICS) + 1
"""Length of the stats vector ``DPO.loss_sum`` returns: the sums behind ``DPO_METRICS``, then the pair count."""


class DocumentSums(torch.autograd.Function):
    """Per-document sums of ``values`` ``[batch, seq]``: ``[batch, width]`` fp64, column d-1 for document
    d (1..width; an absent document sums to 0). Each document is a contiguous run of tokens, so the
    forward takes the difference of an fp64 running sum at its ends (no atomics: deterministic on
    every device); the backward hands each token its document's gradient (a gather: exact)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, document_ids: torch.Tensor, width: int) -> torch.Tensor:
        b, s = values.shape
        pos = torch.arange(s, device=values.device).expand(b, s)
        ends = torch.full((b, width + 1), -1, dtype=torch.long, device=values.device).scatter_reduce(
            1, document_ids, pos, "amax")
        starts = torch.full((b, width + 1), s, dtype=torch.long, device=values.device).scatter_reduce(
            1, document_ids, pos, "amin")
        running = F.pad(values.double().cumsum(1), (1, 0))  # [b, s + 1]: running[:, i] = sum of values[:, :i]
        sums = running.gather(1, ends + 1) - running.gather(1, starts.clamp(max=s))
        ctx.save_for_backward(document_ids)
        ctx.dtype = values.dtype
        return torch.where(ends >= 0, sums, 0.0)[:, 1:]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (document_ids,) = ctx.saved_tensors
        per_document = F.pad(grad, (1, 0))  # padding (document 0) gets no gradient
        return per_document.gather(1, document_ids).to(ctx.dtype), None, None


def document_sums(values: torch.Tensor, document_ids: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, width]`` fp64 sums of ``values`` ``[batch, seq]`` per document 1..width (``DocumentSums``)."""
    return DocumentSums.apply(values, document_ids, width)


@dataclass(frozen=True)
class DPO:
    """The pair losses of ``dpo.loss`` with ``dpo.beta`` and ``dpo.label_smoothing`` (``config.DpoConfig``)."""
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    @classmethod
    def of(cls, cfg) -> "DPO | None":
        """The run's objective (``RunConfig``): a ``DPO``, or None for ``train.objective: sft``."""
        if cfg.train.objective != "dpo":
            return None
        return cls(cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing)

    def loss_sum(self, token_logps: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor,
                 ref_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of this micro-batch's pair losses (fp64, differentiable), ``[STATS]`` fp64 detached sums
        for ``metrics``). ``token_logps`` ``[batch, seq]`` (0 off the answers), ``labels`` and
        ``document_ids`` ``[batch, seq]``, ``ref_logps`` ``[batch, width]`` (width even: pairs x 2)."""
        width = ref_logps.shape[1]
        logps = document_sums(token_logps, document_ids, width)
        with torch.no_grad():
            lengths = document_sums((labels != IGNORE_INDEX).double(), document_ids, width)
            present = document_sums((document_ids > 0).double(), document_ids, width)[:, 1::2] > 0
        chosen, rejected = logps[:, 0::2], logps[:, 1::2]
        chosen_ratio, rejected_ratio = chosen - ref_logps[:, 0::2], rejected - ref_logps[:, 1::2]
        losses = self.pair_losses(chosen_ratio, rejected_ratio, lengths[:, 0::2], lengths[:, 1::2])
        loss_sum = torch.where(present, losses, 0.0).sum()
        with torch.no_grad():
            chosen_rewards, rejected_rewards = self.beta * chosen_ratio, self.beta * rejected_ratio
            parts = (chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).double(),
                     chosen_rewards - rejected_rewards, chosen, rejected, torch.ones_like(chosen))
            stats = torch.stack([torch.where(present, p, 0.0).sum() for p in parts])
        return loss_sum, stats

    def pair_losses(self, chosen_ratio: torch.Tensor, rejected_ratio: torch.Tensor, chosen_tokens: torch.Tensor,
                    rejected_tokens: torch.Tensor) -> torch.Tensor:
        """Per-pair losses from the log-ratios log pi(y|x) - log pi_ref(y|x) of each answer (TRL's
        ``_compute_loss``: IPO averages each answer's log-ratio over its tokens)."""
        margin = chosen_ratio - rejected_ratio
        if self.loss == "sigmoid":
            e = self.label_smoothing
            return -(1 - e) * F.logsigmoid(self.beta * margin) - e * F.logsigmoid(-self.beta * margin)
        if self.loss == "hinge":
            return torch.relu(1 - self.beta * margin)
        if self.loss == "ipo":
            averaged = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            return (averaged - 1 / (2 * self.beta)) ** 2
        raise ValueError(f"dpo.loss={self.loss!r}: expected sigmoid, ipo or hinge")

    @staticmethod
    def metrics(stats: torch.Tensor | list[float], prefix: str = "") -> dict[str, float]:
        """TRL's metrics from ``stats`` summed over the global batch: means over its pairs. Engines pass
        the values they read (one ``.tolist()`` with the loss); a device tensor is read once here."""
        stats = stats.tolist() if isinstance(stats, torch.Tensor) else [float(x) for x in stats]
        pairs = max(stats[-1], 1.0)
        return {prefix + name: value / pairs for name, value in zip(DPO_METRICS, stats)}


def hf_loss_sum(objective: DPO | None, logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(a micro-batch's loss sum, fp64 stats whose last entry counts what the loss is a mean over: valid
    tokens, or pairs) from HF logits ``[batch, seq, vocab]`` (chunked fp32: ``toolkit/loss.py``);
    ``objective`` None: the token cross-entropy (stats ``[tokens]``)."""
    labels = mb["labels"]
    if objective is None:
        total, count = token_loss_sum(logits, labels)
        return total, count.double().view(1)
    return objective.loss_sum(token_logps(logits, labels), labels, mb["document_ids"], mb[REF_COLUMN])


def metrics(objective: DPO | None, stats: torch.Tensor | list[float], prefix: str = "") -> dict[str, float]:
    """The objective's metrics from ``stats`` summed over the global batch ({} for the token cross-entropy)."""
    return {} if objective is None else objective.metrics(stats, prefix)


def hf_document_logps(logits: torch.Tensor, mb: dict, width: int) -> torch.Tensor:
    """``[batch, width]`` fp64 sums of the answers' log-probabilities per document (the reference scores)."""
    return document_sums(token_logps(logits, mb["labels"]), mb["document_ids"], width)
