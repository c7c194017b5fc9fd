"""toolkit.data: sources, checks, tokenize/pack/mask, batch order and sharding, demo tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from toolkit import data
from toolkit.config import DEMO_DIR, validate
from toolkit.data import DataError
from toolkit.data import batches as batches_module
from toolkit.data import tokenizer as tokenizer_module

datasets.disable_progress_bars()

DOCS = ["The quick brown fox jumps over the lazy dog.", "A second document, a little longer than the first one.",
        "Third.", "Return the value of the named attribute of an object, or the default if it is missing."]


def make_cfg(tmp_path: Path, path, **data_kw) -> "data.RunConfig":
    train = data_kw.pop("train", {})
    raw = {"data": {"path": str(path), "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.0,
                    "seq_len": 16, **data_kw},
           "train": {"global_batch_size": 1, "micro_batch_size": 1, **train}}
    return validate(raw)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stream(tok, docs: list[str]) -> list[int]:
    """The expected token stream of template 'none': each document's tokens, then EOS."""
    return [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def rows(ds) -> dict[str, np.ndarray]:
    return ds.with_format("numpy")[:]


# --- packing and masking ---------------------------------------------------------------------

def test_pack_tokens_windows_shift_and_drop():
    ids = np.arange(10, dtype=np.int32)
    loss = np.ones(10, dtype=np.int8)
    out = data.pack_tokens(ids, loss, seq_len=4)  # windows [0..4], [4..8]; 8, 9 dropped
    assert out["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out["labels"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert out["num_loss_tokens"].tolist() == [4, 4]
    loss[:6] = 0  # first window's targets 1..4 carry no loss -> dropped entirely
    out = data.pack_tokens(ids, loss, seq_len=4)
    assert out["labels"].tolist() == [[-100, 6, 7, 8]] and out["num_loss_tokens"].tolist() == [3]
    assert data.pack_tokens(ids[:4], loss[:4], seq_len=4)["input_ids"].shape == (0, 4)


def test_text_packing_matches_eos_separated_stream(tmp_path, tok):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(DOCS * 3) + "\n")
    packed = data.prepare_data(make_cfg(tmp_path, path, seq_len=8), tok)
    r = rows(packed.train)
    expected = stream(tok, DOCS * 3)
    n = (len(expected) - 1) // 8
    assert r["input_ids"].shape == (n, 8) and r["labels"].shape == (n, 8)
    assert r["input_ids"].flatten().tolist() == expected[:n * 8]  # stride seq_len, in order
    assert r["labels"].flatten().tolist() == expected[1:n * 8 + 1]  # shifted by one, all labelled
    assert (r["input_ids"] == tok.eos_token_id).sum() == expected[:n * 8].count(tok.eos_token_id) > 0
    assert r["num_loss_tokens"].tolist() == [8] * n
    assert packed.num_tokens == len(expected) and packed.num_documents == len(DOCS) * 3


def test_instruction_masks_prompt_and_labels_response_and_eos(tmp_path, tok):
    examples = [{"prompt": "Reverse: a b c", "response": "c b a"}, {"prompt": "Say hi", "response": "hi there"}]
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "i.jsonl", examples * 4), template="instruction", packing="concat",
                   seq_len=64)
    r = rows(data.prepare_data(cfg, tok).train)
    ids = r["input_ids"][0]
    labelled = r["labels"][0][r["labels"][0] != -100].tolist()
    eos = tok.eos_token_id
    first = tok(data.INSTRUCTION_TEMPLATE.format(prompt="Reverse: a b c"), add_special_tokens=False)["input_ids"]
    response = tok("c b a", add_special_tokens=False)["input_ids"] + [eos]
    assert ids[:len(first) + len(response)].tolist() == first + response
    assert r["labels"][0][:len(first) - 1].tolist() == [-100] * (len(first) - 1)  # prompt: no loss
    assert r["labels"][0][len(first) - 1:len(first) - 1 + len(response)].tolist() == response
    second = tok("hi there", add_special_tokens=False)["input_ids"] + [eos]
    assert labelled[:len(response) + len(second)] == response + second  # only responses and EOS
    assert r["num_loss_tokens"][0] == len(labelled)


def test_chat_fixed_format_labels_only_assistant_turns(tmp_path, tok):
    conv = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "Ciao"}]}
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "c.jsonl", [conv] * 6), template="chat", packing="concat", seq_len=32)
    labels = rows(data.prepare_data(cfg, tok).train)["labels"].flatten()  # rows are consecutive windows
    labelled = labels[labels != -100].tolist()
    eos = tok.eos_token_id
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert labelled[:len(enc("Hello")) + len(enc("Ciao")) + 2] == enc("Hello") + [eos] + enc("Ciao") + [eos]


def test_chat_template_labels_only_assistant_turns(tmp_path, tok):
    from transformers import AutoTokenizer

    templated = AutoTokenizer.from_pretrained(tok.name_or_path)
    templated.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    conv = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "c.jsonl", [conv] * 8), template="chat", packing="concat", seq_len=16)
    r = rows(data.prepare_data(cfg, templated).train)
    labelled = r["labels"][0][r["labels"][0] != -100].tolist()
    answer = templated("Hello\n", add_special_tokens=False)["input_ids"] + [templated.eos_token_id]
    assert labelled[:len(answer)] == answer


# --- batch order and sharding --------------------------------------------------------------------

def numbered_dataset(n: int, seq_len: int = 3) -> datasets.Dataset:
    """Row i holds input_ids all i, labels all i (or -100 in its first position for odd i)."""
    ids = np.repeat(np.arange(n, dtype=np.int32)[:, None], seq_len, axis=1)
    labels = ids.copy()
    labels[1::2, 0] = -100
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels,
                                       "num_loss_tokens": (labels != -100).sum(1).astype(np.int32)})


@pytest.mark.parametrize("dp,mbs", [(1, 1), (1, 8), (2, 2), (2, 4), (4, 1), (4, 2)])
def test_global_batch_is_the_same_for_any_layout(dp, mbs):
    ds = numbered_dataset(37)
    for step in (0, 4, 9):
        indices = data.global_batch_indices(len(ds), 8, seed=3, step=step)
        got = [mb["input_ids"] for r in range(dp) for mb in data.rank_micro_batches(ds, indices, r, dp, mbs)]
        assert all(t.dtype == torch.long and t.shape == (mbs, 3) for t in got)
        assert torch.cat(got)[:, 0].tolist() == indices  # union of ranks' micro-batches, in order


def test_rank_micro_batches_rejects_uneven_split():
    with pytest.raises(ValueError, match="dp_size=3"):
        data.rank_micro_batches(numbered_dataset(8), list(range(8)), 0, 3, 1)


def test_global_batches_walk_epoch_permutations_and_straddle():
    n, g = 10, 4
    batches = [data.global_batch_indices(n, g, seed=7, step=s) for s in range(5)]
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # each epoch has its own permutation
    assert batches[2] == flat[8:12]  # positions 8..11: the end of epoch 0 and the start of epoch 1
    batches_module._epoch_permutation.cache_clear()
    assert data.global_batch_indices(n, g, seed=7, step=2) == batches[2]  # no dependence on history
    assert data.global_batch_indices(n, g, seed=8, step=0) != batches[0]


def test_count_loss_tokens_and_eval_batches():
    ds = numbered_dataset(10)
    indices = [1, 2, 3, 9]
    fetched = torch.cat([mb["labels"] for mb in data.rank_micro_batches(ds, indices, 0, 1, 2)])
    assert data.count_loss_tokens(ds, indices) == int((fetched != -100).sum()) == 9
    mbs = data.eval_micro_batches(ds, dp_rank=1, dp_size=2, micro_batch_size=2, max_batches=4)
    assert [mb["input_ids"][:, 0].tolist() for mb in mbs] == [[4, 5], [6, 7]]  # 8 of 10 fit fully
    assert data.eval_micro_batches(None, 0, 1, 1, 1) == []


# --- errors --------------------------------------------------------------------------------------

def test_missing_column_names_it_and_lists_columns(tmp_path, tok):
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "d.jsonl", [{"body": "x"}]), text_column="text")
    with pytest.raises(DataError, match=r"data.text_column='text' is not a column .*\['body'\]"):
        data.prepare_data(cfg, tok)


@pytest.mark.parametrize("kind", ["zero-bytes", "no-rows", "blank-text"])
def test_empty_dataset(tmp_path, tok, kind):
    path = tmp_path / "d.jsonl"
    if kind == "zero-bytes":
        path.write_text("")
    elif kind == "no-rows":
        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": []}).save_to_disk(str(path))
    else:
        write_jsonl(path, [{"text": ""}] * 3)
    with pytest.raises(DataError, match="empty|no rows"):
        data.prepare_data(make_cfg(tmp_path, path), tok)


@pytest.mark.parametrize("rows_, match", [
    ([{"text": "a"}, {"text": "b"}, {"text": 5}], r"row 2 holds int 5, not text"),
    ([{"text": "a"}, {"text": None}], r"row 1 holds NoneType None"),
    ([{"text": 1}, {"text": 2}], r"row 0 holds int 1"),
    ([{"text": ["a", "b"]}], r"row 0 holds list"),
])
def test_non_text_values_name_row_and_type(tmp_path, tok, rows_, match):
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "d.jsonl", rows_))
    with pytest.raises(DataError, match=match):
        data.prepare_data(cfg, tok)


@pytest.mark.parametrize("name, lines, where", [
    ("d.jsonl", [b'{"text": "fine"}', b'{"text": "caf\xe9 au lait"}'], "line 2, column 14"),
    ("d.csv", [b"text", b"fine", b"na\xefve"], "line 3, column 3"),
    ("d.txt", [b"fine", b"also fine", b"\xff\xfe bytes"], "line 3, column 1"),
])
def test_bytes_that_are_not_utf8_are_located_in_the_file(tmp_path, tok, name, lines, where):
    """A jsonl with a Latin-1 byte passed the checks (pyarrow keeps invalid strings) and died mid-tokenize with
    UnicodeDecodeError; csv and text said "UnicodeDecodeError ... position N" without the line."""
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=rf"data.path='{path}': {path} {where}: byte 0x[0-9a-f]{{2}} is not UTF-8"
                                        r"; the data must be UTF-8 text: re-encode the file \(e.g. iconv -f latin1 "
                                        r"-t utf-8\) or drop that line"):
        data.prepare_data(make_cfg(tmp_path, path), tok)


def test_malformed_messages_name_row(tmp_path, tok):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [good, {"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"data.messages_column='messages': row 1 holds list"):
        data.prepare_data(make_cfg(tmp_path, path, template="chat"), tok)


def test_too_little_data_says_tokens_samples_and_fix(tmp_path, tok):
    cfg = make_cfg(tmp_path, write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS]),
                   seq_len=16, eval_fraction=0.1, train={"global_batch_size": 16, "micro_batch_size": 1})
    with pytest.raises(DataError, match=r"4 documents, \d+ tokens -> \d+ packed train samples .*"
                                        r"fewer than train.global_batch_size=16; .*data.seq_len"):
        data.prepare_data(cfg, tok)


def test_missing_path_and_offline_hub(tmp_path, tok, monkeypatch):
    with pytest.raises(DataError, match="not found"):
        data.prepare_data(make_cfg(tmp_path, tmp_path / "nope.jsonl"), tok)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="hub dataset, which needs network access"):
        data.prepare_data(make_cfg(tmp_path, "someone/some_dataset"), tok)


# --- sources -------------------------------------------------------------------------------------

def _write_source(tmp_path: Path, kind: str) -> Path:
    table = datasets.Dataset.from_dict({"text": DOCS * 2, "other": list(range(len(DOCS) * 2))})
    if kind == "json":  # one JSON array, not lines
        (path := tmp_path / "d.json").write_text(json.dumps(table.to_list()))
    elif kind == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", table.to_list())
    elif kind == "csv":
        table.to_csv(str(path := tmp_path / "d.csv"))
    elif kind == "parquet":
        table.to_parquet(str(path := tmp_path / "d.parquet"))
    elif kind == "disk":
        datasets.DatasetDict({"train": table}).save_to_disk(str(path := tmp_path / "saved"))
    else:  # glob over two jsonl halves
        write_jsonl(tmp_path / "part-0.jsonl", table.to_list()[:4])
        write_jsonl(tmp_path / "part-1.jsonl", table.to_list()[4:])
        path = tmp_path / "part-*.jsonl"
    return path


@pytest.mark.parametrize("kind", ["json", "jsonl", "csv", "parquet", "disk", "glob"])
def test_sources_give_the_same_samples(tmp_path, tok, kind):
    packed = data.prepare_data(make_cfg(tmp_path, _write_source(tmp_path, kind), seq_len=8), tok)
    expected = stream(tok, DOCS * 2)
    assert rows(packed.train)["input_ids"].flatten().tolist() == expected[:len(packed.train) * 8]


def test_comma_list_and_missing_split(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": d} for d in DOCS])
    packed = data.prepare_data(make_cfg(tmp_path, f"{a},{b}", seq_len=8), tok)
    assert packed.num_documents == 2 * len(DOCS)
    with pytest.raises(DataError, match=r"data.split='validation' is not in .* \['train'\]"):
        data.prepare_data(make_cfg(tmp_path, _write_source(tmp_path, "disk"), split="validation"), tok)


# --- split and caching -----------------------------------------------------------------------------

def test_eval_split_is_deterministic_a_partition_and_at_least_a_global_batch(tmp_path, tok):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(DOCS * 40) + "\n")
    cfg = make_cfg(tmp_path, path, seq_len=8, eval_fraction=0.05, train={"global_batch_size": 8})
    a, b = data.prepare_data(cfg, tok), data.prepare_data(cfg, tok)
    total = len(a.train) + len(a.eval)
    assert len(a.eval) == max(int(np.ceil(total * 0.05)), 8)
    assert rows(a.eval)["input_ids"].tolist() == rows(b.eval)["input_ids"].tolist()
    everything = rows(data.prepare_data(make_cfg(tmp_path, path, seq_len=8), tok).train)["input_ids"]
    split = np.concatenate([rows(a.train)["input_ids"], rows(a.eval)["input_ids"]])
    assert sorted(map(tuple, split.tolist())) == sorted(map(tuple, everything.tolist()))
    reseeded = make_cfg(tmp_path, path, seq_len=8, eval_fraction=0.05, train={"global_batch_size": 8, "seed": 9})
    assert rows(data.prepare_data(reseeded, tok).eval)["input_ids"].tolist() != rows(a.eval)["input_ids"].tolist()


def test_cache_is_reused_and_invalidated_by_new_content(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS * 2])
    cfg = make_cfg(tmp_path, path, seq_len=8)
    first = rows(data.prepare_data(cfg, tok).train)["input_ids"]
    cached = list((tmp_path / "cache" / "packed").glob("*.arrow"))
    assert len(cached) == 1
    assert rows(data.prepare_data(cfg, tok).train)["input_ids"].tolist() == first.tolist()
    assert list((tmp_path / "cache" / "packed").glob("*.arrow")) == cached
    write_jsonl(path, [{"text": d.upper()} for d in DOCS * 2])
    assert rows(data.prepare_data(cfg, tok).train)["input_ids"].tolist() != first.tolist()


# --- demo tokenizer ------------------------------------------------------------------------------

def test_demo_tokenizer_is_deterministic_and_cached(tok, tmp_path, monkeypatch):
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.convert_ids_to_tokens(0) == data.EOS_TOKEN and len(tok) == 2048
    text = "Return the value of the named attribute."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    fresh = data.load_tokenizer(validate({}))  # trained again, in another cache root
    assert fresh.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    built = list((tmp_path / "tokenizers").iterdir())
    assert len(built) == 1 and not built[0].name.startswith(".")  # no temporary directory left
    monkeypatch.setattr(tokenizer_module, "_train_demo_tokenizer", lambda *a: pytest.fail("cache not used"))
    assert data.load_tokenizer(validate({})).backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_tokenizer_from_model_dir_or_field_and_vocab_check(tok, tmp_path):
    model = tmp_path / "model"
    tok.save_pretrained(model)
    config = json.loads((DEMO_DIR / "tiny-llama" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config))
    found = data.load_tokenizer(validate({"model": {"name_or_path": str(model / "config.json")}}))
    assert found.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    named = data.load_tokenizer(validate({"model": {"tokenizer": str(model)}}))
    assert named.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(DataError, match="tokenizer has 2048 tokens but .* vocab_size=1000"):
        data.load_tokenizer(validate({"model": {"name_or_path": str(model)}}))
