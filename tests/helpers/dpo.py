"""Preference pairs for the DPO tests: TRL's ``DPOTrainer`` on a tiny model as the independent reference,
and the same pairs as the toolkit's packed rows (pair j of a row = documents 2j-1 and 2j)."""
from __future__ import annotations

import random

import torch

from toolkit.loss import IGNORE_INDEX


def preference_texts(n: int, seed: int = 0) -> list[dict]:
    """Prompt/chosen/rejected texts of very different lengths (a one-word answer against a long one)."""
    from toolkit.config import DEMO_DIR
    words = [w for w in (DEMO_DIR / "corpus.txt").read_text().split() if w.isalpha()][:5000]
    rng = random.Random(seed)

    def span(k: int) -> str:
        start = rng.randrange(len(words) - k)
        return " " + " ".join(words[start:start + k])
    return [{"prompt": "Question:" + span(rng.randint(2, 12)), "chosen": span(rng.choice([1, rng.randint(5, 20)])),
             "rejected": span(rng.choice([1, rng.randint(5, 20)]))} for _ in range(n)]


def trl_trainer(model, tokenizer, texts: list[dict], out_dir, loss: str, beta: float, batch: int, lr: float = 0.0,
                steps: int = 1, ref_model=None, peft_config=None):
    """TRL's DPOTrainer on ``texts`` (CPU, fp32, no shuffling surprises: read its batches back)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    args = DPOConfig(output_dir=str(out_dir), per_device_train_batch_size=batch, learning_rate=lr, beta=beta,
                     loss_type=[loss], max_steps=steps, report_to=[], use_cpu=True, logging_steps=1,
                     save_strategy="no", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     max_length=None, dataloader_drop_last=True, seed=0, max_grad_norm=None, bf16=False, fp16=False)
    return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(texts),
                      processing_class=tokenizer, peft_config=peft_config)


def rows_of_trl_batch(batch: dict, pairs_per_row: int, seq_len: int) -> dict[str, torch.Tensor]:
    """TRL's collated batch (chosen rows then rejected rows, left-aligned with ``attention_mask`` and
    ``completion_mask``) as the toolkit's preference rows: each sequence one document (inputs ``ids[:-1]``,
    labels ``ids[1:]`` on the completion), ``pairs_per_row`` pairs per row, padded to ``seq_len``."""
    ids, attn, comp = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    n = ids.shape[0] // 2
    docs = []
    for i in range(n):
        for j in (i, n + i):  # chosen, rejected
            length = int(attn[j].sum())
            seq = ids[j, :length]
            labels = seq[1:].masked_fill(comp[j, 1:length] == 0, IGNORE_INDEX)
            docs.append((seq[:-1], labels))
    rows = {"input_ids": [], "labels": [], "document_ids": []}
    for r in range(0, len(docs), 2 * pairs_per_row):
        inp, lab, doc = [], [], []
        for d, (x, y) in enumerate(docs[r:r + 2 * pairs_per_row], start=1):
            inp.append(x)
            lab.append(y)
            doc.append(torch.full_like(x, d))
        inp, lab, doc = torch.cat(inp), torch.cat(lab), torch.cat(doc)
        pad = seq_len - len(inp)
        assert pad >= 0, (len(inp), seq_len)
        rows["input_ids"].append(torch.cat([inp, inp.new_zeros(pad)]))
        rows["labels"].append(torch.cat([lab, lab.new_full((pad,), IGNORE_INDEX)]))
        rows["document_ids"].append(torch.cat([doc, doc.new_zeros(pad)]))
    return {k: torch.stack(v) for k, v in rows.items()}


def write_preference_data(path, n: int = 160, seed: int = 0):
    """JSONL of ``preference_texts``: pairs whose answers range from one word to twenty."""
    import json
    path.write_text("".join(json.dumps(r) + "\n" for r in preference_texts(n, seed)))
    return path



def held_models(engine) -> dict:
    """What the process holds (gc): ``models``, live transformers models not inside another (a reference
    model beside the policy would be a second); ``live_param_bytes``, all live parameters' bytes (unique
    storages); ``param_bytes``, the engine module's parameters' bytes."""
    import gc

    from transformers import PreTrainedModel
    gc.collect()
    objects = gc.get_objects()
    models = [o for o in objects if isinstance(o, PreTrainedModel)]
    inner = {id(m) for o in models for m in o.modules() if m is not o}
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in objects if isinstance(p, torch.nn.Parameter)}
    return {"models": sum(id(o) not in inner for o in models), "live_param_bytes": sum(storages.values()),
            "param_bytes": sum(p.numel() * p.element_size() for p in engine.engine.module.parameters())}


FP32_UNIT_ROUNDOFF = 2.0 ** -24


def fp32_sum_rounding(objective, policy_tokens: torch.Tensor, reference_tokens: torch.Tensor, labels: torch.Tensor,
                      document_ids: torch.Tensor, width: int) -> float:
    """The fp32 rounding scale of a DPO loss whose answers' log-probabilities are summed in fp32 (TRL) rather
    than fp64 (the toolkit), relative to the loss: u * sum over answer tokens of |dL/dS_a| * (|x_t| + |r_t|) / |L|,
    with S_a the sum of answer a that token t belongs to, x_t and r_t its policy and reference log-probabilities
    and u fp32's unit roundoff. It is the first-order change of L when every term of every sum is off by one
    rounding (a sum of n terms in fp32 is off by at most (n-1) u sum |terms|; torch's vectorized sums by about
    log2(n) of them); the loss kind, beta and the answers' lengths all enter through dL/dS_a."""
    from toolkit.objectives import document_sums
    x = policy_tokens.detach().double().requires_grad_(True)
    ref = document_sums(reference_tokens.detach().double(), document_ids, width)
    loss_sum, stats = objective.loss_sum(x, labels, document_ids, ref)
    loss = loss_sum / stats[-1]
    loss.backward()
    terms = x.grad.abs() * (policy_tokens.detach().double().abs() + reference_tokens.detach().double().abs())
    return FP32_UNIT_ROUNDOFF * terms.sum().item() / abs(loss.item())

