"""Preference pairs (``data.template: preference``, toolkit/data/templates.py and pack.py): each pair's
prompt and answers tokenize as TRL's ``DPOTrainer`` prepares them (plain text and conversational,
chat template or not), rows hold whole pairs in every packing (so ranks and micro-batches do too),
documents-packed rows hold what pad rows hold, and bad rows or layouts are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from tests.helpers.packing import packed as packed_documents
from tests.helpers.packing import random_documents
from tests.helpers.preference import (
    CHAT_TEMPLATE,
    CHATML_TEMPLATE,
    THINKING_TEMPLATE,
    documents_of,
    pairs_of,
    trl_prepared,
)
from toolkit import data
from toolkit.config import ConfigError, validate
from toolkit.data import DataError
from toolkit.data.pack import pack_pairs

datasets.disable_progress_bars()

PLAIN = [
    {"prompt": "The quick brown", "chosen": " fox jumps over the lazy dog.", "rejected": " dog lazy the over."},
    {"prompt": "Return the value of the named ", "chosen": "attribute of an object.", "rejected": "object an."},
    {"prompt": "Hello", "chosen": "world", "rejected": " there, how are you today?<|endoftext|>"},  # merges, EOS
    {"prompt": "Count: one two", "chosen": " three", "rejected": " five four three two one zero"},
]
NO_PROMPT = {"prompt": "", "chosen": "An answer without a prompt.", "rejected": "Prompt without answer."}
CONVERSATIONS = [
    {"prompt": [{"role": "user", "content": "Name a color."}],
     "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "The color of a color is color."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count to three"}],
     "chosen": [{"role": "assistant", "content": "1 2 3"}],
     "rejected": [{"role": "assistant", "content": "three two one"}]},
]


def make_cfg(tmp_path: Path, path, **data_kw):
    train = data_kw.pop("train", {})
    raw = {"data": {"path": str(path), "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.0,
                    "seq_len": 256, "template": "preference", **data_kw},
           "train": {"global_batch_size": 1, "micro_batch_size": 1, **train}}
    if raw["data"]["template"] == "preference":  # pairs train only with DPO (config.py)
        raw["train"]["objective"] = "dpo"
    return validate(raw)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(ds) -> dict[str, np.ndarray]:
    return ds.with_format("numpy")[:]


def prepared_pairs(tmp_path, examples, tokenizer, **kw) -> tuple:
    packed = data.prepare_data(make_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", examples), **kw), tokenizer)
    return packed, pairs_of(rows(packed.train))


# --- against TRL -----------------------------------------------------------------------------------

TEMPLATES = {"chat template": CHAT_TEMPLATE, "thinking template": THINKING_TEMPLATE, "chatml": CHATML_TEMPLATE}


@pytest.mark.parametrize("form", ["plain", "plain+bos", *TEMPLATES])
def test_pairs_tokenize_as_trl_dpo_trainer_prepares_them(tmp_path, tok, form):
    """Prompt, chosen and rejected ids of every pad row equal TRL 1.16's ``_prepare_dataset``
    (prompt_ids, chosen_ids, rejected_ids) row by row, including a prompt ending inside a merged
    token, an answer already ending in EOS, a tokenizer adding BOS, a template rendering the prompt
    alone differently."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer, examples = AutoTokenizer.from_pretrained(tok.name_or_path), PLAIN + [NO_PROMPT]
    if form == "plain+bos":
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.eos_token_id)])
    elif form != "plain":
        tokenizer.chat_template = TEMPLATES[form]
        examples = CONVERSATIONS
    packed = data.prepare_data(make_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", examples), packing="pad"),
                               tokenizer)
    expected = trl_prepared(examples, tokenizer)
    if form == "plain":  # the cases the examples are there for do happen
        assert any(len(p) < len(tokenizer(e["prompt"])["input_ids"]) for (p, _, _), e in zip(expected, examples))
        assert any(not p for p, _, _ in expected)
    # pad: row k holds pair k; each document = prompt + answer, loss on the answer's targets (all
    # but its first token when there is no prompt: that one is no position's target, in TRL too)
    ours = []
    for inputs, labels in [d for docs in documents_of(rows(packed.train)) for d in docs]:
        learnt = sum(t != -100 for t in labels)
        assert all(t != -100 for t in labels[len(labels) - learnt:]), "the loss is not the answer's tail"
        ours.append((inputs + labels[-1:], learnt))
    assert ours == [(p + a, len(a) - (not p)) for p, c, r in expected for a in (c, r)], "differs from TRL"
    assert pairs_of(rows(packed.train.select([k for k, (p, _, _) in enumerate(expected) if p]))) == \
        [e for e in expected if e[0]]
    assert packed.num_pairs == len(examples) and packed.num_overflow == 0


def test_conversations_without_a_chat_template_use_the_fixed_chat_format(tmp_path, tok):
    """No chat template: each document reads as template ``chat`` renders prompt + answer
    (CHAT_HEADERS, answer then EOS), and carries loss exactly where ``chat`` does."""
    _, ours = prepared_pairs(tmp_path, CONVERSATIONS, tok, packing="pad")
    for k, example in enumerate(CONVERSATIONS):
        for side, answer in ((1, "chosen"), (2, "rejected")):
            path = write_jsonl(tmp_path / f"chat{k}{side}.jsonl", [{"messages": example["prompt"] + example[answer]}])
            chat = data.prepare_data(make_cfg(tmp_path, path, template="chat", packing="pad"), tok)
            inputs, labels = documents_of(rows(chat.train))[0][0]
            last = max(i for i, v in enumerate(labels) if v != -100)
            prompt, mine = ours[k][0], ours[k][side]
            assert prompt + mine == inputs[:last + 1] + [labels[last]]  # the same tokens
            # the chat template labels every assistant turn; the pair only the answer after its prompt
            assert [t for t in labels[len(prompt) - 1:last + 1]] == mine


# --- rows hold whole pairs ------------------------------------------------------------------------

def random_pairs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` pairs as ``pack_pairs`` takes them: documents (prompt + answer), prompts shared."""
    docs, loss = [], []
    for prompt, a, b in zip(random_documents(n, seed, lengths=(1, 12)), random_documents(n, seed + 1),
                            random_documents(n, seed + 2)):
        for answer in (a, b):
            docs.append(np.concatenate([prompt, answer]))
            loss.append(np.r_[np.zeros(len(prompt), np.int8), np.ones(len(answer), np.int8)])
    return np.concatenate(docs), np.concatenate(loss), np.array([len(d) for d in docs])


def pair_contents(out: dict) -> list[tuple]:
    """Each pair's two documents as (inputs, labels) tuples: pair j of a row is documents 2j-1, 2j."""
    return [tuple(map(tuple, docs[j] + docs[j + 1])) for docs in documents_of(out) for j in range(0, len(docs), 2)]


@pytest.mark.parametrize("mode", ["documents", "pad"])
def test_rows_ranks_and_micro_batches_hold_whole_pairs(mode):
    ids, loss, lengths = random_pairs(60, seed=3)
    seq_len = 40
    out = pack_pairs(ids, loss, lengths, seq_len, mode)
    docs = out["document_ids"]
    assert (out["num_documents"] == 2 * out["num_pairs"]).all() and (docs.max(axis=1) == out["num_documents"]).all()
    for row in docs:  # documents 1, 2, ... in order, each pair's two side by side, padding at the end
        used = row[row > 0]
        assert (np.diff(used) >= 0).all() and set(used.tolist()) == set(range(1, used.max() + 1))
        assert (row[len(used):] == 0).all()
    inputs = np.maximum(lengths - 1, 0).reshape(-1, 2).sum(axis=1)
    assert out["num_pairs"].sum() == (inputs <= seq_len).sum() < 60  # only the overflowing pairs are gone
    if mode == "pad":
        assert (out["num_pairs"] == 1).all()
    else:
        assert out["num_pairs"].max() > 1 and out["num_tokens"].max() <= seq_len
    ds = datasets.Dataset.from_dict({k: v.tolist() for k, v in out.items()})
    n = len(ds) // 4 * 4
    counts = data.batch_counts(ds, list(range(n)))
    seen = 0
    for dp_rank in range(2):
        for mb in data.rank_micro_batches(ds, list(range(n)), dp_rank, dp_size=2, micro_batch_size=2):
            for row in mb["document_ids"]:
                top = int(row.max())
                assert top % 2 == 0 and all((row == d).any() for d in range(1, top + 1))  # whole pairs
                seen += top // 2
    assert counts["pairs"] == seen == int(out["num_pairs"][:n].sum())
    assert counts["documents"] == 2 * counts["pairs"]
    none_fit = pack_pairs(ids, loss, lengths, 3, mode)  # every pair overflows: no rows, right shapes
    assert none_fit["input_ids"].shape == (0, 3) and none_fit["num_pairs"].shape == (0,)


def test_documents_packed_rows_hold_what_pad_rows_hold(tmp_path, tok):
    examples = [{"prompt": p["prompt"] + f" {k}", "chosen": p["chosen"], "rejected": p["rejected"]}
                for k in range(6) for p in PLAIN]
    path = write_jsonl(tmp_path / "p.jsonl", examples)
    made = {mode: data.prepare_data(make_cfg(tmp_path, path, packing=mode, seq_len=64), tok)
            for mode in ("pad", "documents")}
    pad, docs = (rows(made[m].train) for m in ("pad", "documents"))
    assert len(docs["input_ids"]) < len(pad["input_ids"])  # several pairs per row
    assert sorted(pair_contents(docs)) == sorted(pair_contents(pad))
    for column in ("num_loss_tokens", "num_tokens", "num_documents", "num_pairs"):
        assert docs[column].sum() == pad[column].sum(), column


def test_long_pairs_are_dropped_and_counted(tmp_path, tok):
    long = {"prompt": "A prompt", "chosen": " a short answer", "rejected": " word" * 40}  # 2 documents fit alone
    path = write_jsonl(tmp_path / "p.jsonl", PLAIN + [long])
    packed = data.prepare_data(make_cfg(tmp_path, path, seq_len=48), tok)
    assert packed.num_overflow == 1 and packed.num_pairs == len(PLAIN) + 1
    assert rows(packed.train)["num_pairs"].sum() == len(PLAIN)
    assert make_cfg(tmp_path, path).data.overflow == "drop"  # the default for pairs


def test_pairs_whose_answers_are_the_same_are_dropped_and_counted(tmp_path, tok):
    """chosen == rejected scores one sequence twice: the margin is 0 whatever the weights, so no DPO loss
    (sigmoid, ipo, hinge, label smoothing) has a gradient from it; kept, it only adds a constant to the loss
    and a pair to the mean's denominator (each real pair's step shrinks). Dropped, and counted."""
    same = [{"prompt": "Say it", "chosen": " again", "rejected": " again"},
            {"prompt": "Twice", "chosen": " the same<|endoftext|>", "rejected": " the same"}]  # equal once tokenized
    packed = data.prepare_data(make_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", PLAIN + same)), tok)
    assert packed.num_pairs == len(PLAIN) + 2 and packed.num_identical_pairs == 2
    assert rows(packed.train)["num_pairs"].sum() == len(PLAIN)
    assert sorted(pairs_of(rows(packed.train))) == sorted(pairs_of(rows(data.prepare_data(
        make_cfg(tmp_path, write_jsonl(tmp_path / "q.jsonl", PLAIN)), tok).train)))


def test_data_with_no_pair_that_differs_is_refused(tmp_path, tok):
    """Every pair identical trained silently (the loss flat at log 2: nothing to learn)."""
    path = write_jsonl(tmp_path / "p.jsonl", [dict(e, rejected=e["chosen"]) for e in PLAIN])
    with pytest.raises(DataError, match=r"data.path='.*p.jsonl': all 4 pairs have the same chosen and rejected answer "
                                        r"\(data.chosen_column='chosen', data.rejected_column='rejected'\); DPO learns "
                                        r"from their difference"):
        data.prepare_data(make_cfg(tmp_path, path), tok)


def test_eval_split_cache_key_and_counts(tmp_path, tok):
    examples = [dict(e, prompt=e["prompt"] + f" {k}") for k in range(10) for e in PLAIN]  # 40 pairs
    path = write_jsonl(tmp_path / "p.jsonl", examples)
    cfg = make_cfg(tmp_path, path, packing="pad", eval_fraction=0.2, train={"global_batch_size": 4})
    packed = data.prepare_data(cfg, tok)
    train, evals = rows(packed.train), rows(packed.eval)
    assert len(evals["input_ids"]) == 8 and len(train["input_ids"]) == 32
    assert sorted(pair_contents(train) + pair_contents(evals)) == sorted(pair_contents(
        rows(data.prepare_data(make_cfg(tmp_path, path, packing="pad"), tok).train)))
    batches = data.eval_micro_batches(packed.eval, 0, 2, 2, 4)
    assert sum(int(mb["document_ids"].max(dim=1).values.sum()) for mb in batches) == 2 * 4  # whole pairs
    # the cache key holds the columns: swapped answers are not read back from the first run's cache
    swapped = rows(data.prepare_data(make_cfg(tmp_path, path, packing="pad", chosen_column="rejected",
                                              rejected_column="chosen"), tok).train)
    assert [(p, r, c) for p, c, r in pairs_of(swapped)] == pairs_of(rows(data.prepare_data(
        make_cfg(tmp_path, path, packing="pad"), tok).train))
    documents = packed_documents(random_documents(4, 0), 24, "documents")
    documents = datasets.Dataset.from_dict({k: v.tolist() for k, v in documents.items()})
    assert data.batch_counts(documents, [0])["pairs"] is None  # not preference data


# --- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"packing": "concat"}, r"data.packing='concat' cannot hold preference pairs.*documents.*pad"),
    ({"overflow": "split"}, r"data.overflow='split' cannot cut a preference pair.*data.overflow=drop"),
])
def test_layouts_that_would_split_a_pair_are_refused(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        make_cfg(tmp_path, "x.jsonl", **kw)


@pytest.mark.parametrize("bad, match", [
    ({"chosen": None}, r"data.chosen_column='chosen': row 1 holds NoneType None, but the prompt .* is text"),
    ({"rejected": ""}, r"data.rejected_column='rejected': row 1 is an empty answer.*fix or drop that row"),
    ({"prompt": 7}, r"data.prompt_column='prompt': row 1 holds int 7, not text or a list of .*messages"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "chosen": "Hello"},
     r"data.chosen_column='chosen': row 1 holds str 'Hello', not a list of .*messages"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "chosen": [],
      "rejected": [{"role": "assistant", "content": "x"}]}, r"data.chosen_column='chosen': row 1 is an empty message list"),
])
def test_bad_rows_name_row_column_and_fix(tmp_path, tok, bad, match):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(PLAIN[0]) + "\n" + json.dumps(dict(PLAIN[0], **bad)) + "\n")
    with pytest.raises(DataError, match=match):
        data.prepare_data(make_cfg(tmp_path, path), tok)


def test_missing_column_names_the_field(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "good": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=r"data.chosen_column='chosen' is not a column .*'good'.*preference"):
        data.prepare_data(make_cfg(tmp_path, path), tok)


def test_too_few_rows_names_the_pairs(tmp_path, tok):
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", PLAIN), packing="pad",
                   train={"global_batch_size": 8})
    with pytest.raises(DataError, match=r"fewer than train.global_batch_size=8; add pairs \(data.packing=pad keeps"):
        data.prepare_data(cfg, tok)
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", PLAIN * 2), seq_len=16, train={"global_batch_size": 2})
    with pytest.raises(DataError, match=r"; 8 of 8 pairs are longer than data.seq_len=16 .* dropped: raise data.seq_len"):
        data.prepare_data(cfg, tok)


# --- the example's data ---------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["text", "chat"])
def test_example_pairs_prefer_the_corpus_order_and_pack_whole(tmp_path, tok, form):
    """examples/dpo/make_pairs.py: chosen = the corpus continuation, rejected = its words in another
    order; deterministic; held-out lines differ; every pair fits seq_len 128 (text) or 256 (chat)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_pairs", Path(__file__).parents[2] / "examples/dpo/make_pairs.py")
    make_pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_pairs)
    train, held_out = make_pairs.make_pairs(40, seed=1, form=form, held_out=10)
    assert (train, held_out) == make_pairs.make_pairs(40, seed=1, form=form, held_out=10)
    text = (lambda v: v) if form == "text" else (lambda v: v[0]["content"])
    corpus = make_pairs.CORPUS.read_text()
    for row in train + held_out:
        chosen, rejected = text(row["chosen"]), text(row["rejected"])
        assert chosen != rejected and sorted(chosen.split()) == sorted(rejected.split())
        if form == "text":
            assert row["prompt"] + chosen in corpus
    assert not {json.dumps(r["prompt"]) for r in train} & {json.dumps(r["prompt"]) for r in held_out}
    seq_len = 128 if form == "text" else 256  # the fixed chat format adds its headers to each document
    packed = data.prepare_data(make_cfg(tmp_path, write_jsonl(tmp_path / "p.jsonl", train), seq_len=seq_len), tok)
    assert packed.num_overflow == 0 and rows(packed.train)["num_pairs"].sum() == 40
