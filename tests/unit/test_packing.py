"""Packed fine-tuning without cross-document attention (``data.packing``): rows, counts and cache keys
(toolkit/data/pack.py); on the HF path (toolkit/adapters/hf_attention.py) every document of a packed
row gives the logits of that document alone through HF's own model, and a packed batch the gradients
of the same documents padded; MoE routing statistics count real tokens only."""
from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch

from tests.helpers.packing import GRAD_RTOL, LOGITS_ATOL, micro_batch, packed, random_documents
from toolkit import data
from toolkit.adapters import hf_attention
from toolkit.config import validate
from toolkit.data.pack import document_pieces, fit_rows
from toolkit.families.tiny import tiny_model
from toolkit.loss import IGNORE_INDEX, token_loss_sum

datasets.disable_progress_bars()


def pieces_of(rows: dict) -> list[tuple[list[int], list[int]]]:
    """(inputs, labels) of every document piece in the rows, row by row."""
    out = []
    for ids, labels, docs in zip(rows["input_ids"], rows["labels"], rows["document_ids"]):
        for d in range(1, docs.max() + 1):
            at = docs == d
            out.append((ids[at].tolist(), labels[at].tolist()))
    return out


# --- rows ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["documents", "pad"])
def test_rows_hold_whole_documents_and_no_target_crosses_a_boundary(mode):
    docs = random_documents(40, seed=0)
    rows = packed(docs, 24, mode)
    got = sorted(pieces_of(rows))
    want = sorted((d[:-1].tolist(), d[1:].tolist()) for d in docs)  # each document alone, shifted by one
    assert got == want  # every document once, whole (all fit in 24), its targets its own next tokens
    pad = rows["document_ids"] == 0
    assert (rows["labels"][pad] == IGNORE_INDEX).all() and (rows["input_ids"][pad] == 0).all()
    assert not (np.diff(pad.astype(int), axis=1) < 0).any()  # padding only at the tail
    assert rows["num_tokens"].tolist() == (~pad).sum(axis=1).tolist()
    assert rows["num_loss_tokens"].tolist() == (rows["labels"] != IGNORE_INDEX).sum(axis=1).tolist()
    assert rows["num_documents"].tolist() == rows["document_ids"].max(axis=1).tolist()
    if mode == "pad":
        assert (rows["num_documents"] == 1).all() and len(rows["input_ids"]) == len(docs)
    else:  # best fit decreasing: within a row or two of the bound total tokens / seq_len
        assert len(rows["input_ids"]) <= -(-rows["num_tokens"].sum() // 24) + 1


def test_best_fit_is_deterministic_and_never_overfills():
    lengths = np.random.default_rng(1).integers(1, 17, 300)
    rows = fit_rows(lengths, 16)
    assert rows == fit_rows(lengths, 16)
    assert sorted(p for r in rows for p in r) == list(range(300))
    assert max(lengths[r].sum() for r in rows) <= 16
    assert fit_rows(np.array([3, 2, 5, 1, 4]), 5) == [[2], [4, 3], [0, 1]]


def test_overflow_splits_or_drops_long_documents():
    long = np.arange(1, 12, dtype=np.int32)  # 10 input/target pairs > seq_len 4
    short = np.array([20, 21, 22], dtype=np.int32)
    start, length = document_pieces(np.array([11, 3, 1]), 4, "split")  # a lone EOS gives nothing
    assert start.tolist() == [0, 4, 8, 11] and length.tolist() == [4, 4, 2, 2]
    split = pieces_of(packed([long, short], 4, "documents", "split"))
    assert sorted(split) == sorted([([1, 2, 3, 4], [2, 3, 4, 5]), ([5, 6, 7, 8], [6, 7, 8, 9]),
                                    ([9, 10], [10, 11]), ([20, 21], [21, 22])])
    assert pieces_of(packed([long, short], 4, "documents", "drop")) == [([20, 21], [21, 22])]
    assert packed([np.array([0], dtype=np.int32)], 4, "documents")["input_ids"].shape == (0, 4)  # nothing to train


def test_pieces_without_loss_are_left_out():
    docs = [np.array([1, 2, 3]), np.array([4, 5, 6])]
    loss = np.array([0, 0, 0, 0, 1, 1], dtype=np.int8)  # the first document has no loss token
    rows = packed(docs, 8, "documents", loss=loss)
    assert pieces_of(rows) == [([4, 5], [5, 6])]


def write_instructions(path, n: int = 24, long_every: int = 6):
    rows = [{"prompt": f"Reverse {i}: " + "a b c", "response": " ".join(["word"] * (40 if i % long_every == 0 else 3))}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_config(tmp_path, path, **data_kw):
    return validate({"data": {"path": str(path), "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.0,
                              "seq_len": 32, "template": "instruction", **data_kw},
                     "train": {"global_batch_size": 2, "micro_batch_size": 1}})


def test_modes_default_cache_keys_counts_and_micro_batches(tmp_path, tok):
    path = write_instructions(tmp_path / "i.jsonl")
    assert data_config(tmp_path, path).data.packing_mode == "documents"  # instruction's default
    assert validate({}).data.packing_mode == "concat"  # plain text keeps concat
    made = {}
    for mode, overflow in [("documents", "split"), ("documents", "drop"), ("pad", "split"), ("concat", "split")]:
        cfg = data_config(tmp_path, path, packing=mode, overflow=overflow)
        made[mode, overflow] = data.prepare_data(cfg, tok)
    files = {k: v.train.cache_files[0]["filename"] for k, v in made.items()}
    assert len(set(files.values())) == 4  # the cache key holds the mode and the overflow rule
    docs, pad, drop = made["documents", "split"], made["pad", "split"], made["documents", "drop"]
    assert docs.num_overflow == pad.num_overflow == drop.num_overflow == 4 and made["concat", "split"].num_overflow == 0
    assert len(docs.train) < len(pad.train)

    def total(made_data, column: str) -> int:
        return int(np.asarray(made_data.train.with_format("numpy")[column]).sum())
    for column in ("num_loss_tokens", "num_tokens", "num_documents"):
        assert total(docs, column) == total(pad, column)  # the same documents, grouped differently
    assert total(drop, "num_documents") < total(docs, "num_documents")
    again = data.prepare_data(data_config(tmp_path, path, packing="documents"), tok)  # from the cache: identical
    assert again.train.with_format("numpy")[:]["input_ids"].tolist() == docs.train.with_format("numpy")[:]["input_ids"].tolist()
    micro = data.rank_micro_batches(docs.train, [0, 1], dp_rank=0, dp_size=1, micro_batch_size=1)
    assert set(micro[0]) == {"input_ids", "labels", "document_ids"} and micro[0]["document_ids"].dtype == torch.int64
    counts = data.batch_counts(docs.train, [0, 1])
    assert counts["tokens"] == int((torch.cat([m["document_ids"] for m in micro]) > 0).sum())
    assert data.batch_counts(made["concat", "split"].train, [0])["tokens"] == 32


# --- the HF path -----------------------------------------------------------------------------------

# RoPE llama3; biases, tied; learned positions; MoE; softcap + windows
FAMILIES = ("llama", "qwen2", "gpt2", "qwen2_moe", "gemma2")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_document_of_a_packed_row_is_that_document_alone_through_hf(family):
    model = tiny_model(family)
    docs = random_documents(9, seed=2, vocab=model.config.vocab_size, lengths=(4, 15))
    alone = [model(input_ids=torch.from_numpy(d[:-1]).long()[None]).logits[0] for d in docs]  # HF's own sdpa
    mb = micro_batch(packed(docs, 32, "documents"))
    assert (mb["document_ids"].amax(dim=1) > 1).all()  # every row holds several documents
    hf_attention.use_document_attention(model)
    inputs = hf_attention.forward_inputs(mb)
    logits = model(**inputs).logits
    hf_attention.check_applied(inputs)
    by_tokens = {tuple(d[:-1].tolist()): a for d, a in zip(docs, alone)}
    worst, seen = 0.0, 0
    for row, ids, doc_ids in zip(logits, mb["input_ids"], mb["document_ids"]):
        for d in range(1, int(doc_ids.max()) + 1):
            want = by_tokens[tuple(ids[doc_ids == d].tolist())]
            worst, seen = max(worst, (row[doc_ids == d] - want).abs().max().item()), seen + 1
    print(f"\n{family}: max |logit diff| packed vs alone {worst:.2e}")
    assert seen == len(docs) and worst < LOGITS_ATOL


def test_boundaries_are_never_ignored_silently():
    """A model left on sdpa ignores the layout keyword: the forward raises; and the layout really
    confines attention (the same rows as one document give other logits)."""
    model = tiny_model("llama")
    docs = random_documents(4, seed=3, lengths=(6, 10))
    mb = micro_batch(packed(docs, 40, "documents"))
    inputs = hf_attention.forward_inputs(mb)
    model(**inputs)
    with pytest.raises(RuntimeError, match="attention would cross documents"):
        hf_attention.check_applied(inputs)
    hf_attention.use_document_attention(model)
    confined = model(**hf_attention.forward_inputs(mb)).logits
    one_document = {**mb, "document_ids": (mb["document_ids"] > 0).long()}
    assert (model(**hf_attention.forward_inputs(one_document)).logits - confined).abs().max() > 1e-2
    q = torch.zeros(1, 2, 3, 4)  # transformers drops a 2D padding mask for an implementation it does not know
    with pytest.raises(ValueError, match="not an attention_mask"):
        hf_attention.document_attention(None, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2_moe"])
def test_packed_batch_gives_the_gradients_of_the_same_documents_padded(family):
    docs = random_documents(10, seed=4, lengths=(4, 15))
    grads = {}
    for mode in ("documents", "pad"):
        model = hf_attention.use_document_attention(tiny_model(family))
        mb = micro_batch(packed(docs, 32, mode))
        loss_sum, count = token_loss_sum(model(**hf_attention.forward_inputs(mb)).logits, mb["labels"])
        (loss_sum / count).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["documents"].keys() == grads["pad"].keys()
    worst = max(((grads["documents"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
                for n, g in grads["pad"].items())
    print(f"\n{family}: max per-parameter relative grad diff packed vs padded {worst:.2e}")
    assert worst < GRAD_RTOL


def test_moe_routing_statistics_count_real_tokens_only():
    """The same documents padded one per row and packed: the router loss sees the same real tokens
    (tokens per expert equal, aux equal); counting padding would make them differ."""
    from toolkit.adapters.deepspeed.moe import RouterLoss
    model = hf_attention.use_document_attention(tiny_model("qwen2_moe"))
    docs = random_documents(10, seed=5, lengths=(4, 15))
    cfg = validate({})
    results = {}
    for mode in ("documents", "pad"):
        mb = micro_batch(packed(docs, 32, mode))
        out = model(**hf_attention.forward_inputs(mb), output_router_logits=True)
        for masked in (True, False):
            router = RouterLoss(cfg, model)
            aux = router.loss(out.router_logits, hf_attention.real_tokens(mb) if masked else None)
            results[mode, masked] = (router.stats.counts.clone(), float(aux.detach()))
    (c_docs, a_docs), (c_pad, a_pad) = results["documents", True], results["pad", True]
    assert torch.equal(c_docs, c_pad) and a_docs == pytest.approx(a_pad, rel=1e-5)
    assert not torch.equal(results["documents", False][0], results["pad", False][0])


def test_a_moe_config_without_its_top_k_is_refused():
    """The load-balancing loss needs the router's top-k: an HF MoE config.json without it is named, not guessed."""
    from toolkit.adapters.deepspeed.moe import RouterLoss
    from toolkit.config import ConfigError
    model = tiny_model("mixtral")
    model.config.num_experts_per_tok = 0  # transformers 5 types the field an int: 0 stands for a config without it
    with pytest.raises(ConfigError, match=r"mixtral: an HF mixture-of-experts config without num_experts_per_tok; "
                                          r".*set it in config.json"):
        RouterLoss(validate({}), model)


def test_too_few_rows_names_the_packing(tmp_path, tok):
    cfg = validate({"data": {"path": str(write_instructions(tmp_path / "few.jsonl", n=3)), "seq_len": 32,
                             "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.0, "template": "instruction"},
                    "train": {"global_batch_size": 8, "micro_batch_size": 1}})
    with pytest.raises(data.DataError, match="data.packing=documents makes at most one row per document"):
        data.prepare_data(cfg, tok)


def test_the_logged_attention_path_names_the_kernel():
    assert "documents -> sdpa" in hf_attention.describe("cpu", dropout=False) and "per document span" in \
        hf_attention.describe("cpu", dropout=False)
    assert "documents -> math" in hf_attention.describe("cpu", dropout=False, softcap=True)
    assert "documents -> flex" in hf_attention.describe("cuda", dropout=False) and "block mask" in \
        hf_attention.describe("cuda", dropout=False)
    assert "documents -> sdpa" in hf_attention.describe("cuda", dropout=True)  # flex has no dropout


def test_a_model_that_does_not_take_the_attention_is_refused_naming_the_fix():
    """A model whose attention does not dispatch through transformers' AttentionInterface keeps its
    own implementation: switching to ours (documents, Ulysses) is refused, never silently ignored."""
    from types import SimpleNamespace

    from toolkit.adapters.deepspeed.ulysses import use_ulysses_attention
    from toolkit.adapters.hf_attention import use_document_attention

    class Stubborn(torch.nn.Module):
        config = SimpleNamespace(_attn_implementation="eager")

        def set_attn_implementation(self, name):
            pass  # ignores it, as a model with hard-wired attention does

    with pytest.raises(RuntimeError, match="did not take attn_implementation.*use data.packing=concat"):
        use_document_attention(Stubborn())
    with pytest.raises(RuntimeError, match="did not take attn_implementation.*zero.sp > 1"):
        use_ulysses_attention(Stubborn())
