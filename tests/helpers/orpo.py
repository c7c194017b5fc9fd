"""TRL's ``ORPOTrainer`` (trl.experimental.orpo) as the independent reference for ORPO, and its collated batch
as the toolkit's preference rows."""
from __future__ import annotations

import torch

from tests.helpers.dpo import rows_of_trl_batch
from toolkit.loss import IGNORE_INDEX


def trl_orpo_trainer(model, tokenizer, texts: list[dict], out_dir, beta: float, batch: int):
    """TRL's ORPOTrainer on ``texts`` (CPU, fp32, no gradient checkpointing; batches read back in order)."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    args = ORPOConfig(output_dir=str(out_dir), per_device_train_batch_size=batch, beta=beta, report_to=[],
                      use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, max_length=512,
                      remove_unused_columns=False, dataloader_drop_last=True, seed=0, save_strategy="no")
    return ORPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(texts), processing_class=tokenizer)


def rows_of_orpo_batch(batch: dict, pairs_per_row: int, seq_len: int) -> dict[str, torch.Tensor]:
    """ORPOTrainer's collated batch (``chosen_*``, ``rejected_*``: right-padded, labels -100 on the prompt) as
    the toolkit's rows (``rows_of_trl_batch``), with the count columns the packed data has (``num_pairs``)."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

    def padded(key: str, value) -> torch.Tensor:
        parts = [torch.nn.functional.pad(batch[f"{side}_{key}"], (0, width - batch[f"{side}_{key}"].shape[1]),
                                         value=value) for side in ("chosen", "rejected")]
        return torch.cat(parts)
    dpo_batch = {"input_ids": padded("input_ids", 0), "attention_mask": padded("attention_mask", 0),
                 "completion_mask": (padded("labels", IGNORE_INDEX) != IGNORE_INDEX).long()}
    rows = rows_of_trl_batch(dpo_batch, pairs_per_row, seq_len)
    rows["num_pairs"] = (rows["document_ids"].amax(1) + 1) // 2
    return rows


METRIC_SCALE = {"rewards/margins": ("rewards/chosen", "rewards/rejected"),
                "log_odds_chosen": ("logps/chosen", "logps/rejected")}
"""Differences of two near-equal means are measured against their operands' size (a margin of 0.006 between
two rewards of -0.77 carries their rounding, 3.8e-6 of itself); every other metric against its own size."""


def metric_gap(name: str, mine: dict, theirs: dict, prefix: str = "") -> float:
    """|mine - theirs| of metric ``name`` (``prefix``: ``eval_``) relative to its scale (``METRIC_SCALE``)."""
    scale = sum(abs(theirs[prefix + k]) for k in METRIC_SCALE.get(name, (name,)))
    return abs(mine[prefix + name] - theirs[prefix + name]) / max(scale, 1e-12)
