"""Odds-ratio preference optimization (ORPO, ``train.objective: orpo``; Hong et al. 2024) as TRL's
``ORPOTrainer`` defines it: no reference model. On ``data.template: preference`` rows (pair j of a row is
document 2j - 1, prompt + chosen, and document 2j, prompt + rejected; ``dpo.py``) the loss of a global batch is

    NLL  -  beta x mean over pairs of log sigmoid(log_odds)

with NLL the mean token cross-entropy over every token of the chosen documents, prompt included (TRL: "orpo
chosen nll loss is computed over the full prompt and response"), and per pair, from each answer's mean token
log-probability p (its log-probability over its answer tokens), log_odds = (p_c - p_r) - (log(1 - e^p_c) -
log(1 - e^p_r)). ``orpo.beta`` is TRL's ``beta`` (the paper's lambda). The metrics are TRL's, means over the
pairs (``nll_loss`` over the chosen tokens): rewards = beta x p, accuracies, margins, logps, the
log-odds ratio and the chosen log-odds; TRL's ``logits/*`` (the mean logit over its padded rectangle) have no
counterpart in packed rows.

Two means with two counts: the engines divide the loss sum by the global batch's pairs (``count``), so the NLL
sum enters weighted by pairs / chosen tokens of that global batch, which this objective's hook attaches to each
micro-batch (``ChosenTokens``; TRL's own numbers when the global batch is its batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from toolkit.loss import IGNORE_INDEX
from toolkit.objectives.base import Objective, as_floats, document_sums, pairs_present

ORPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/rejected",
                "logps/chosen", "log_odds_ratio", "log_odds_chosen")
"""TRL's metric names that are means over the pairs (``nll_loss`` is one over the chosen tokens)."""
NLL_WEIGHT = "orpo_nll_weight"
"""The micro-batch column of pairs / chosen tokens of its global batch (or eval), one value per row."""


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, branching at -ln 2 against cancellation (TRL's ``log1mexp``)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def chosen_document_labels(input_ids: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """``labels`` with the chosen documents (odd ids) labelled on every token, prompt included: the next
    token of its document (the last keeps its own label, its answer's last token)."""
    docs = document_ids[:, :-1]
    inside = (docs == document_ids[:, 1:]) & (docs % 2 == 1)
    following = torch.where(inside, input_ids[:, 1:].to(labels.dtype), labels[:, :-1])
    return torch.cat([following, labels[:, -1:]], dim=1)


@dataclass(frozen=True)
class ORPO(Objective):
    beta: float = 0.1

    name: ClassVar[str] = "orpo"
    stats_size: ClassVar[int] = len(ORPO_METRICS) + 3
    count: ClassVar[str] = "pairs"
    logged_count: ClassVar[str] = "pairs"
    eval_count: ClassVar[str] = "eval_pairs"

    @classmethod
    def of(cls, cfg) -> "ORPO":
        return cls(cfg.orpo.beta)

    def __call__(self, scores, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(NLL sum x pairs / chosen tokens - beta x sum of log sigmoid(log_odds) over the micro-batch's pairs,
        fp64 ``[sums behind ORPO_METRICS, NLL sum, chosen tokens, pairs]``)."""
        labels, docs = mb["labels"], mb["document_ids"]
        whole = chosen_document_labels(mb["input_ids"], labels, docs)
        logps = scores.logps(whole)
        answers = labels != IGNORE_INDEX
        width = docs.shape[1] + docs.shape[1] % 2  # room for every document a row can hold
        sums = document_sums(torch.where(answers, logps, 0.0), docs, width)
        with torch.no_grad():
            lengths = document_sums(answers.double(), docs, width).clamp(min=1)
            chosen_tokens = ((whole != IGNORE_INDEX) & (docs % 2 == 1)).sum().double()
        present = pairs_present(docs, width)
        mean = sums / lengths
        # an absent pair's means are 0, where log(1 - e^0) is -inf: a NaN that would reach the gradient
        chosen, rejected = (torch.where(present, m, -1.0) for m in (mean[:, 0::2], mean[:, 1::2]))
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        nll_sum = -torch.where(docs % 2 == 1, logps, 0.0).double().sum()
        loss_sum = nll_sum * mb[NLL_WEIGHT][0] - self.beta * torch.where(present, ratio, 0.0).sum()
        with torch.no_grad():
            rc, rr = self.beta * chosen, self.beta * rejected
            parts = (rc, rr, (rc > rr).double(), rc - rr, rejected, chosen, ratio, log_odds, torch.ones_like(chosen))
            pair_sums = [torch.where(present, p, 0.0).sum() for p in parts]
            stats = torch.stack([*pair_sums[:-1], nll_sum.detach(), chosen_tokens, pair_sums[-1]])
        return loss_sum, stats

    def metrics(self, stats: torch.Tensor | list[float], prefix: str = "") -> dict[str, float]:
        """TRL's metrics from ``stats`` summed over a global batch: means over its pairs; ``nll_loss`` over
        its chosen documents' tokens."""
        values = as_floats(stats)
        pairs, nll, tokens = max(values[-1], 1.0), values[-3], max(values[-2], 1.0)
        out = {prefix + name: value / pairs for name, value in zip(ORPO_METRICS, values)}
        out[prefix + "nll_loss"] = nll / tokens
        return out

    def prepare(self, cfg, engine, data, log, phase) -> "ChosenTokens":
        return ChosenTokens({"train": data.train, "eval": data.eval})


class ChosenTokens:
    """ORPO's hook (``objectives.base.Prepared``): attaches pairs / chosen tokens of the whole global batch
    (every rank's rows, counted from their ``document_ids`` and ``num_pairs``) to each micro-batch."""
    key = None  # nothing scored: a checkpoint records no key and resumes anywhere

    def __init__(self, sets: dict):
        self.sets = sets

    def attach(self, split: str, micro_batches: list[dict], indices: list[int],
               batch: list[int] | None = None) -> list[dict]:
        rows = self.sets[split].with_format("numpy", columns=["document_ids", "num_pairs"])[[int(i) for i in batch]]
        docs = np.asarray(rows["document_ids"])
        # a chosen document of n positions predicts n tokens (inputs doc[:-1], labels doc[1:])
        weight = float(rows["num_pairs"].sum()) / max(int((docs % 2 == 1).sum()), 1)
        for mb in micro_batches:
            mb[NLL_WEIGHT] = torch.full((len(mb["input_ids"]),), weight, dtype=torch.float64)
        return micro_batches

    def check_resumed(self, saved: str | None) -> None:
        pass
