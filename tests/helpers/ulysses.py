"""Ulysses sequence parallelism (``zero.sp``) against HF's own model: the packed rows with uneven loss
tokens, HF's single-process reference of them (each document run alone through HF's own attention),
and the tolerances the parity tests share."""
from __future__ import annotations

import numpy as np
import torch

from tests.helpers.lora import ALPHA, RANK
from tests.helpers.packing import packed, random_documents
from toolkit.loss import IGNORE_INDEX, token_loss_sum

SEQ = 32
LOGIT_TOL = 2e-6
"""max |sp logits - HF's| at real tokens; measured (llama, qwen2, gemma2, llama MQA) <= 4.8e-7."""
GRAD_RTOL = 2e-5
"""Per parameter: max |sp - HF| <= GRAD_RTOL x max |HF| of that parameter's gradient; measured <= 3.1e-6."""
LOSS_RTOL = 1e-6


def rows(packing: str, n: int = 2, seed: int = 5, vocab: int = 250, per_micro: int = 1) -> list[dict]:
    """``n`` micro-batches of ``per_micro`` ``SEQ``-token rows each. ``documents``: random documents
    packed whole (several per row, some crossing the middle of the row, where sp=2 splits it), about
    half their targets without loss, so rows and halves of rows hold uneven loss tokens; ``concat``:
    one stream per row, no document_ids."""
    rng = np.random.default_rng(seed)
    docs = random_documents(24 * per_micro, seed, vocab=vocab, lengths=(3, 14))
    loss = np.concatenate([(rng.random(len(d)) < 0.55).astype(np.int8) for d in docs])
    out = packed(docs, SEQ, "documents", loss=loss)
    keys = ("input_ids", "labels", "document_ids") if packing == "documents" else ("input_ids", "labels")
    assert len(out["input_ids"]) >= n * per_micro, "too few documents for the rows asked"
    return [{k: torch.from_numpy(out[k][i * per_micro:(i + 1) * per_micro]).long() for k in keys} for i in range(n)]


def documents_of(mb: dict, row: int = 0) -> list[tuple[int, int]]:
    """(start, stop) of each document of row ``row`` of a micro-batch (the whole row without
    document_ids); the padded tail (document id 0) is left out."""
    if "document_ids" not in mb:
        return [(0, mb["input_ids"].shape[1])]
    docs = mb["document_ids"][row].tolist()
    spans, start = [], 0
    for i in range(1, len(docs) + 1):
        if i == len(docs) or docs[i] != docs[start]:
            if docs[start] > 0:
                spans.append((start, i))
            start = i
    return spans


def hf_reference(model, micro_batches: list[dict], aux_coeff: float | None = None) -> dict:
    """HF's own model on each document alone (positions from 0, its own causal mask, window and
    softcap as transformers applies them): logits per micro-batch (real tokens; padding NaN), grads of
    sum(token losses) / valid tokens, the loss and the gradient's global norm.

    ``aux_coeff`` (a mixture-of-experts model): the objective adds ``aux_coeff`` x the mean over the
    micro-batches of ``router_reference``'s aux, the toolkit's contract (``toolkit/adapters/moe.py``);
    ``aux`` and ``expert_tokens`` are then what the step's metrics must report."""
    model.zero_grad()
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    total, logits, auxes, counts = 0.0, [], [], 0
    for mb in micro_batches:
        scored = torch.full((*mb["input_ids"].shape, model.config.vocab_size), float("nan"))
        objective, routed = 0.0, []  # MoE: the aux loss joins the documents of a micro-batch
        for r, (start, stop) in ((r, span) for r in range(len(scored)) for span in documents_of(mb, r)):
            ids = mb["input_ids"][r:r + 1, start:stop]
            out = model(input_ids=ids) if aux_coeff is None else model(input_ids=ids, output_router_logits=True)
            loss, _ = token_loss_sum(out.logits, mb["labels"][r:r + 1, start:stop])
            total += loss.item()
            scored[r:r + 1, start:stop] = out.logits.detach()
            if aux_coeff is None:
                (loss / tokens).backward()
            else:
                objective, routed = objective + loss / tokens, routed + [out.router_logits]
        if aux_coeff is not None:
            aux, layer_counts = router_reference(model.config, routed)
            (objective + aux_coeff * aux / len(micro_batches)).backward()
            auxes.append(aux.item())
            counts = counts + layer_counts
        logits.append(scored)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    out = {"logits": logits, "grads": grads, "loss": total / tokens, "grad_norm": norm, "tokens": tokens}
    if aux_coeff is not None:
        out |= {"aux": sum(auxes) / len(auxes), "expert_tokens": counts.tolist()}
    return out


def router_reference(config, routed: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's aux loss and tokens per expert ``[layers, E]`` from the router logits of its
    documents run alone (``routed``: per document, one ``[len, E]`` tensor per MoE layer), by
    transformers' own ``load_balancing_loss_func`` of the family over the whole micro-batch's real
    tokens. The toolkit's aux is the mean over layers of each layer's loss, so the function is given one
    layer at a time (given every layer, transformers pools their counts and probabilities into one
    term instead: equal for one layer); the padded tail never reaches it (documents only)."""
    import importlib
    hf = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    experts, k = routed[0][0].shape[-1], config.num_experts_per_tok
    layers = [torch.cat([z.reshape(-1, experts) for z in layer]) for layer in zip(*routed)]
    aux = sum(hf.load_balancing_loss_func((z,), experts, k) for z in layers) / len(layers)
    counts = torch.stack([torch.nn.functional.one_hot(z.topk(k).indices, experts).sum((0, 1)) for z in layers])
    return aux, counts


def grad_ratios(got: dict, ref: dict) -> dict[str, float]:
    """Per parameter: max |got - ref| / max |ref|."""
    assert sorted(got) == sorted(ref), (sorted(set(got) ^ set(ref)))
    return {n: ((got[n] - g).abs().max() / g.abs().max()).item() for n, g in ref.items() if g.abs().max() > 0}


def sp_engine(base: str, world: int, stage: int, packing: str, ckpt: bool, sp: int = 2, zero: dict | None = None,
              lora: bool = False, train: dict | None = None, **extra):
    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    from toolkit.config import validate
    from toolkit.plan import build_plan
    cfg = validate({"model": {"name_or_path": base, "init": "pretrained", "activation_checkpointing": ckpt},
                    "zero": zero or {"stage": stage, "sp": sp}, "data": {"seq_len": SEQ, "packing": packing},
                    "train": {"global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-3, **(train or {})}, **extra,
                    **({"lora": {"rank": RANK, "alpha": ALPHA}} if lora else {})})
    plan = build_plan(cfg, [world])
    model = build_model(plan, plan.ds_config(world))
    if lora:  # the seeded non-zero adapters the peft reference gets
        from tests.helpers.lora import adapter_values
        with torch.no_grad():
            for name, value in adapter_values(model).items():
                model.get_parameter(name).copy_(value)
    return plan, DeepSpeedEngine(plan, model)


def observed_step(engine, micro_batches, tokens):
    """``train_step`` as the trainer calls it, recording this rank's logits of each forward and every
    parameter's whole gradient at the accumulation boundary (before the optimizer steps)."""
    from deepspeed.utils import safe_get_full_grad
    logits, grads = [], {}
    forward, step = engine._forward, engine.engine.step

    def recording_forward(mb, router=True):
        out = forward(mb, router)
        logits.append(out.logits.detach().clone())
        return out

    def recording_step():
        if engine.engine.is_gradient_accumulation_boundary():
            grads.update({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
                          if p.requires_grad})
        step()
    engine._forward, engine.engine.step = recording_forward, recording_step
    stats = engine.train_step(micro_batches, tokens, 1e-3)
    engine._forward, engine.engine.step = forward, step
    return stats, logits, grads
