"""ORPO's math (``toolkit/objectives/orpo.py``) against TRL's ``ORPOTrainer`` (an independent reference): on the
same tiny Llama and the same pairs (TRL tokenizes and collates them; the toolkit packs the same tokens two pairs
per row, documents confined), TRL's loss, every parameter's gradient and TRL's metrics, the rows taken as one
micro-batch or as one micro-batch per row (the NLL weighted by the global batch's chosen tokens: the hook)."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.dpo import preference_texts
from tests.helpers.orpo import metric_gap, rows_of_orpo_batch, trl_orpo_trainer
from toolkit.loss import LogitScores
from toolkit.objectives.orpo import ORPO, ORPO_METRICS, ChosenTokens

BETA = 0.25
# Measured on this machine's CPU (fp32 TRL against fp64 sums here), relative: loss 8.3e-8 (either split),
# gradients 8.0e-7 (worst parameter, max |diff| / max |grad|), metrics <= 1.7e-7 (log_odds_ratio; metric_gap).
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
METRIC_RTOL = 1e-6

@pytest.fixture(scope="module")
def trl_step(tmp_path_factory):
    """TRL's loss, gradients and metrics on its first batch of 4 pairs, and that batch as the toolkit's rows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.adapters.hf_attention import use_document_attention
    from toolkit.config import DEMO_DIR, load_config
    from toolkit.data import load_tokenizer
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_DIR / "tiny-llama"))
    trainer = trl_orpo_trainer(copy.deepcopy(policy), load_tokenizer(load_config(None, [])), preference_texts(8),
                               tmp_path_factory.mktemp("orpo"), BETA, batch=4)
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._stored_metrics["train"].items()}
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    return {"loss": loss.item(), "metrics": metrics, "grads": grads, "policy": use_document_attention(policy),
            "rows": rows_of_orpo_batch(batch, pairs_per_row=2, seq_len=160)}


def _toolkit_step(trl_step, micro_batches: list[slice]):
    """The toolkit's loss (summed over ``micro_batches`` of the rows, as an engine sums them, / pairs), its
    gradients and metrics; each micro-batch gets the whole batch's NLL weight from ``ChosenTokens``."""
    from datasets import Dataset

    from toolkit.adapters.hf_attention import forward_inputs
    rows, model = trl_step["rows"], copy.deepcopy(trl_step["policy"])
    hook = ChosenTokens({"train": Dataset.from_dict({k: rows[k].tolist() for k in ("document_ids", "num_pairs")})})
    objective, totals = ORPO(BETA), 0
    for part in micro_batches:
        mb = {k: v[part] for k, v in rows.items()}
        mb, = hook.attach("train", [mb], list(range(len(rows["input_ids"])))[part], list(range(len(rows["input_ids"]))))
        loss_sum, stats = objective(LogitScores(model(**forward_inputs(mb)).logits), mb)
        (loss_sum / int(rows["num_pairs"].sum())).backward()
        totals = totals + torch.cat([loss_sum.detach().view(1), stats])
    pairs = int(totals[-1])
    return totals[0].item() / pairs, objective.metrics(totals[1:]), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("split", ["one_micro_batch", "a_micro_batch_per_row"])
def test_loss_gradients_and_metrics_equal_trl(split, trl_step):
    rows = len(trl_step["rows"]["input_ids"])
    parts = [slice(0, rows)] if split == "one_micro_batch" else [slice(r, r + 1) for r in range(rows)]
    loss, metrics, grads = _toolkit_step(trl_step, parts)
    gap = abs(loss - trl_step["loss"]) / abs(trl_step["loss"])
    worst = max(((g - trl_step["grads"][n]).abs().max() / trl_step["grads"][n].abs().max()).item()
                for n, g in grads.items())
    metric_gaps = {k: metric_gap(k, metrics, trl_step["metrics"]) for k in trl_step["metrics"]
                   if not k.startswith("logits/")}
    print(f"\n{split}: loss {trl_step['loss']:.6f} relative gap {gap:.1e}; worst gradient gap {worst:.1e}; "
          f"metrics {', '.join(f'{k} {v:.1e}' for k, v in metric_gaps.items())}")
    assert gap < LOSS_RTOL
    assert worst < GRAD_RTOL
    assert set(metric_gaps) == {*ORPO_METRICS, "nll_loss"}
    assert max(metric_gaps.values()) < METRIC_RTOL, metric_gaps
    assert 0 < trl_step["metrics"]["rewards/accuracies"] < 1  # pairs on both sides: a swap would show


def test_config_takes_orpo_on_preference_pairs():
    from toolkit.config import ConfigError, load_config
    from toolkit.plan import build_plan
    with pytest.raises(ConfigError, match="train.objective=orpo needs preference pairs"):
        load_config(None, ["train.objective=orpo"])
    with pytest.raises(ConfigError, match="train.objective=orpo does not run with zero.sp=2"):
        load_config(None, ["data.template=preference", "train.objective=orpo", "zero.sp=2"])
    with pytest.raises(ConfigError, match="orpo.beta"):
        load_config(None, ["data.template=preference", "train.objective=orpo", "orpo.beta=0"])
    cfg = load_config(None, ["data.template=preference", "train.objective=orpo", "orpo.beta=0.2"])
    assert build_plan(cfg, [2]).objective == ORPO(0.2)
