"""Direct preference optimization (DPO, ``train.objective: dpo``) as TRL's ``DPOTrainer`` defines it
(``sigmoid``, ``ipo``, ``hinge``; TRL's metric names).

Rows of preference pairs (``data.template: preference``) hold whole pairs: in a row, pair j
(1-based) is document ``2j - 1`` (prompt + chosen) and document ``2j`` (prompt + rejected) of its
``document_ids`` (0 = padding), with loss labels on the answers only. The engines give per-token
log-probabilities ``[batch, seq]`` (``Scores.logps``); here they are summed per document (``document_sums``,
in fp64), paired, and turned into pair losses against the reference model's sums (``ref_logps``,
``[batch, width]`` per document, fp64), which this objective's hook scores once before training
(``prepare``: ``toolkit/objectives/reference.py``).

The loss is the mean pair loss over the global batch: ``count`` is its pairs (``toolkit/objectives/base.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from toolkit.loss import IGNORE_INDEX
from toolkit.objectives.base import Objective, as_floats, document_sums, pairs_present
from toolkit.objectives.reference import REF_COLUMN, prepare_reference

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")
"""TRL's metric names, each a mean over the pairs of the global batch (``DPO.metrics``)."""
STATS = len(DPO_METRICS) + 1
"""Length of the stats vector ``DPO.loss_sum`` returns: the sums behind ``DPO_METRICS``, then the pair count."""


@dataclass(frozen=True)
class DPO(Objective):
    """The pair losses of ``dpo.loss`` with ``dpo.beta`` and ``dpo.label_smoothing`` (``config.DpoConfig``)."""
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    name: ClassVar[str] = "dpo"
    stats_size: ClassVar[int] = STATS
    count: ClassVar[str] = "pairs"
    logged_count: ClassVar[str] = "pairs"
    eval_count: ClassVar[str] = "eval_pairs"

    @classmethod
    def of(cls, cfg) -> "DPO":
        return cls(cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing)

    def __call__(self, scores, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``loss_sum`` of the micro-batch's answers against its reference scores (``REF_COLUMN``)."""
        return self.loss_sum(scores.logps(mb["labels"]), mb["labels"], mb["document_ids"], mb[REF_COLUMN])

    def prepare(self, cfg, engine, data, log, phase):
        """The reference model's per-document scores (``reference.py``): read from the cache, or scored by
        ``engine`` now, while it still holds the starting model."""
        return prepare_reference(cfg, engine, data, log=log, beat=phase("load"))

    def loss_sum(self, token_logps: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor,
                 ref_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of this micro-batch's pair losses (fp64, differentiable), ``[STATS]`` fp64 detached sums
        for ``metrics``). ``token_logps`` ``[batch, seq]`` (0 off the answers), ``labels`` and
        ``document_ids`` ``[batch, seq]``, ``ref_logps`` ``[batch, width]`` (width even: pairs x 2)."""
        width = ref_logps.shape[1]
        logps = document_sums(token_logps, document_ids, width)
        with torch.no_grad():
            lengths = document_sums((labels != IGNORE_INDEX).double(), document_ids, width)
        present = pairs_present(document_ids, width)
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
        stats = as_floats(stats)
        pairs = max(stats[-1], 1.0)
        return {prefix + name: value / pairs for name, value in zip(DPO_METRICS, stats)}

