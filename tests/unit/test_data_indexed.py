"""Megatron indexed datasets (``toolkit/data/indexed*.py``), ``toolkit prepare`` and blends, against
megatron-core's own builder, reader and blending helper."""
from __future__ import annotations

import filecmp
import json
import random
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from toolkit.config import validate
from toolkit.data import DataError, prepare_data
from toolkit.data.batches import batch_indices
from toolkit.data.blend import Blend, blend_block
from toolkit.data.indexed import IndexedPrefix, write_prefix
from toolkit.data.prepare import describe_prefix, prepare_prefix

datasets.disable_progress_bars()
indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")

DOCS = [[5, 6, 7, 0], [9, 0], [], [1, 2, 3, 4, 5, 0], [0]]


def builder_prefix(prefix: str, docs: list[list[int]], vocab: int, sentences: int = 1) -> None:
    """A prefix written by megatron-core's ``IndexedDatasetBuilder``; ``sentences`` > 1 cuts each document
    into that many sequences, as ``preprocess_data.py --split-sentences`` does."""
    builder = indexed_dataset.IndexedDatasetBuilder(prefix + ".bin", dtype=indexed_dataset.DType.optimal_dtype(vocab))
    for doc in docs:
        for piece in np.array_split(np.asarray(doc, np.int64), sentences):
            builder.add_item(torch.from_numpy(piece))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("vocab, dtype", [(250, np.uint16), (70_000, np.int32)])
def test_our_writer_is_byte_identical_to_megatron_and_both_readers_agree(tmp_path, vocab, dtype):
    builder_prefix(str(tmp_path / "mc"), DOCS, vocab)
    write_prefix(str(tmp_path / "ours"), DOCS, dtype)
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(tmp_path / f"ours{ext}", tmp_path / f"mc{ext}", shallow=False), ext
    theirs = indexed_dataset.IndexedDataset(str(tmp_path / "ours"))  # kept alive: its items are views of its mmap
    assert [theirs[i].tolist() for i in range(len(theirs))] == DOCS
    ours = IndexedPrefix(str(tmp_path / "ours"))
    start, length = ours.document_spans(0, ours.num_documents)
    assert [ours.tokens[s:s + n].tolist() for s, n in zip(start, length)] == DOCS


def test_documents_of_several_sequences_read_whole(tmp_path):
    """A ``--split-sentences`` prefix: a document is the tokens of all its sequences."""
    docs = [[1, 2, 3, 4, 5, 0], [7, 8, 9, 0]]
    builder_prefix(str(tmp_path / "split"), docs, 250, sentences=2)
    ours = IndexedPrefix(str(tmp_path / "split"))
    assert len(ours.sequence_lengths) == 4 and ours.num_documents == 2
    start, length = ours.document_spans(0, 2)
    assert [ours.tokens[s:s + n].tolist() for s, n in zip(start, length)] == docs


# --- toolkit prepare, and training rows from a prefix ------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tok):
    """1,500 documents of 0-40 words (empty ones among them), as text and as instruction pairs."""
    root = tmp_path_factory.mktemp("indexed")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "quick", "fox", "jumps", "over", "lazy", "dog", "Zürich"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 40))) for _ in range(1500)]
    (root / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "inst.jsonl").write_text("".join(json.dumps({"prompt": t[:30], "response": t[30:] or "ok"}) + "\n"
                                             for t in texts[:1200]))
    return root, texts


def cfg_for(root: Path, path, **data) -> "object":
    return validate({"data": {"path": str(path), "cache_dir": str(root / "cache"), "seq_len": 32,
                              "eval_fraction": 0.05, **data},
                     "train": {"global_batch_size": 8, "micro_batch_size": 2}})


def same_rows(a, b) -> bool:
    x, y = a.with_format("numpy")[:], b.with_format("numpy")[:]
    return sorted(x) == sorted(y) and all(np.array_equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("template, packing", [("none", "concat"), ("none", "documents"), ("instruction", "documents")])
def test_prepared_prefix_reads_back_with_megatron_and_trains_on_the_rows_of_its_source(corpus, tok, template, packing):
    root, texts = corpus
    source = root / ("text.jsonl" if template == "none" else "inst.jsonl")
    out = str(root / f"{template}-{packing}")
    extra = {"template": template, "packing": packing}
    meta = prepare_prefix(cfg_for(root, source, num_proc=2 if packing == "concat" else 1, **extra), out,
                          progress=False)
    if template == "none":  # one document per row, each the tokenizer's ids + EOS (empty rows dropped)
        want = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts if t]
        theirs = indexed_dataset.IndexedDataset(out)
        assert len(theirs) == len(want) == meta["documents"]
        assert all(theirs[i].tolist() == want[i] for i in range(len(want)))
    else:  # the loss mask rides in PREFIX_loss, itself a prefix megatron reads
        mask = indexed_dataset.IndexedDataset(out + "_loss")
        assert len(mask) == meta["documents"] and 0 < sum(int(mask[i].sum()) for i in range(len(mask))) < meta["tokens"]
    from_source = prepare_data(cfg_for(root, source, **extra), tok)
    from_prefix = prepare_data(cfg_for(root, out, **extra), tok)
    assert same_rows(from_source.train, from_prefix.train) and same_rows(from_source.eval, from_prefix.eval)
    assert (from_source.num_tokens, from_source.num_documents, from_source.num_overflow) == \
        (from_prefix.num_tokens, from_prefix.num_documents, from_prefix.num_overflow)
    assert describe_prefix(out)["documents"] == meta["documents"]


def test_a_foreign_prefix_without_eos_gets_it_appended(corpus, tok):
    """megatron's builder, no sidecar, no EOS (preprocess_data.py without --append-eod), empty documents
    between: the toolkit skips those and appends EOS as it packs, so its rows equal the jsonl's."""
    root, texts = corpus
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts if t]
    builder_prefix(str(root / "foreign"), [d for doc in ids for d in (doc, [])], len(tok))  # empty ones: skipped
    from_source = prepare_data(cfg_for(root, root / "text.jsonl"), tok)
    assert same_rows(from_source.train, prepare_data(cfg_for(root, root / "foreign"), tok).train)
    with_eos = [d + [tok.eos_token_id] for d in ids]
    builder_prefix(str(root / "foreign-eos"), with_eos, len(tok))
    assert same_rows(from_source.train, prepare_data(cfg_for(root, root / "foreign-eos.bin"), tok).train)


def test_prefix_problems_are_refused_with_the_fix(corpus, tok, tmp_path):
    root, _ = corpus
    cases = {}
    builder_prefix(str(tmp_path / "mixed"), [[5, 0], [6, 7]] * 10, len(tok))
    cases["mixed"] = "end with EOS"
    builder_prefix(str(tmp_path / "beyond"), [[5, len(tok) + 3, 0]] * 10, 70_000)
    cases["beyond"] = f"token id {len(tok) + 3} is outside"
    write_prefix(str(tmp_path / "narrow"), [[5, 0]], np.uint8)
    cases["narrow"] = "stored as uint8"
    write_prefix(str(tmp_path / "half"), [[5, 0]], np.uint16)
    (tmp_path / "half.idx").unlink()
    cases["half"] = "half.idx is missing"
    write_prefix(str(tmp_path / "other"), [[5, 0]] * 10, np.uint16)
    (tmp_path / "other.json").write_text(json.dumps({"format": "toolkit-indexed", "tokenizer": {"name": "gpt2",
                                                                                                  "key": "x"}}))
    cases["other"] = "prepared with tokenizer 'gpt2'"
    for name, message in cases.items():
        with pytest.raises(DataError, match=message):
            prepare_data(cfg_for(root, tmp_path / name), tok)
    with pytest.raises(DataError, match="mixes Megatron indexed datasets"):
        prepare_data(cfg_for(root, f"{tmp_path / 'other'},{root / 'text.jsonl'}"), tok)
    with pytest.raises(DataError, match="names no indexed dataset"):
        prepare_data(cfg_for(root, root / "text.jsonl", format="megatron"), tok)
    with pytest.raises(DataError, match="exists"):
        prepare_prefix(cfg_for(root, root / "text.jsonl"), str(tmp_path / "other"), progress=False)


def test_prepare_restarts_afresh_over_a_killed_run(corpus, tok, tmp_path):
    """A killed prepare leaves only PREFIX.partial.* files; the next run writes the same prefix."""
    root, _ = corpus
    cfg = cfg_for(root, root / "text.jsonl")
    prepare_prefix(cfg, str(tmp_path / "a"), progress=False)
    (tmp_path / "b.partial.bin").write_bytes(b"\x07" * 1000)  # what a kill leaves
    (tmp_path / "b.partial.bin.lengths").write_bytes(b"\x07" * 12)
    prepare_prefix(cfg, str(tmp_path / "b"), progress=False)
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(tmp_path / f"a{ext}", tmp_path / f"b{ext}", shallow=False)
    assert not list(tmp_path.glob("b.partial*"))


# --- blends ---------------------------------------------------------------------------------------

def test_blend_rule_is_megatrons_and_realizes_the_weights_at_every_step():
    from megatron.core.datasets import helpers_cpp
    for weights in ([0.8, 0.2], [0.5, 0.3, 0.2]):
        n = 3000
        src, idx = np.zeros(n, np.int16), np.zeros(n, np.int64)
        helpers_cpp.build_blending_indices(src, idx, np.array(weights), len(weights), n, False)
        first, _, counts = blend_block(weights, 0, [0] * len(weights), 1234)
        second = blend_block(weights, 1234, counts, n - 1234)[0]  # a block started from the counts alone
        assert np.array_equal(np.concatenate([first, second]), src)
        assert np.array_equal(blend_block(weights, 0, [0] * len(weights), n)[1], idx)
    blend = Blend(names=["a", "b"], weights=[0.8, 0.2], sizes=[37, 11], seed=3)
    rows = np.concatenate([blend.global_batch(step, 8) for step in range(125)])  # 1,000 samples
    share = np.cumsum(blend.source_of(rows) == 0) / np.arange(1, 1001)
    assert abs(share[-1] - 0.8) <= 0.01 and np.all(np.abs(share[7::8] - 0.8) <= 0.1)  # every step boundary
    assert np.abs(np.cumsum(blend.source_of(rows) == 0) - 0.8 * np.arange(1, 1001)).max() <= 1
    fresh = Blend(names=["a", "b"], weights=[0.8, 0.2], sizes=[37, 11], seed=3)  # a resume: nothing cached
    assert fresh.global_batch(124, 8) == rows[-8:].tolist()
    first_epoch = [r for r in rows if r < 37][:37]  # a source's order: whole epochs, each row once in each
    assert sorted(first_epoch) == list(range(37))


def test_blend_of_prefixes_trains_from_its_sources_rows(corpus, tok):
    root, _ = corpus
    cfg = cfg_for(root, f"{root / 'none-concat'},{root / 'text.jsonl'}", weights=[3, 1])
    data = prepare_data(cfg, tok)
    assert data.blend.weights == [0.75, 0.25] and data.blend.names == ["none-concat", "text"]
    alone = prepare_data(cfg_for(root, root / "text.jsonl"), tok)
    assert data.blend.sizes == [len(alone.train)] * 2 and len(data.eval) == 2 * len(alone.eval)
    rows = batch_indices(data, 8, 1234, 5)
    assert rows == batch_indices(data, 8, 99, 5)  # the blend's order is seeded by train.seed at prepare
    for bad, message in (([1], "one weight per source"), ([1, -1], "not a positive number"),
                         ([1, 0], "not a positive number")):
        with pytest.raises(DataError, match=message):
            prepare_data(cfg_for(root, f"{root / 'none-concat'},{root / 'text.jsonl'}", weights=bad), tok)


# --- streaming -------------------------------------------------------------------------------------

def test_a_stream_resumes_at_the_exact_row_inside_a_chunk_at_its_edge_and_across_epochs(corpus, tok):
    """Batches of 8 from chunks of 50 source rows over 150 rows (3 chunks an epoch): a new pipeline seeked
    to ``position(s)`` gives the uninterrupted batches from s on, for s inside a chunk, at a chunk's
    edge and past an epoch; one streamed epoch holds the rows of packing each chunk alone."""
    import json as json_module

    from toolkit.data.stream import StreamBatches
    root, _ = corpus
    small = root / "small.jsonl"
    small.write_text("".join((root / "text.jsonl").read_text().splitlines(keepends=True)[:150]))
    cfg = cfg_for(root, small, eval_fraction=0, streaming=True)

    def rows(ds):
        return ds.with_format("numpy")[:]["input_ids"].tolist()
    whole = StreamBatches(cfg, tok, chunk_docs=50)
    batches, positions = [], []
    for step in range(100):
        positions.append(json_module.loads(json_module.dumps(whole.position(step))))  # through trainer.json
        batches.append(rows(whole.global_batch(step, 8)))
    epochs = {p["epoch"] for p in positions}
    straddles = [s for s in range(99) if positions[s]["chunk"] != positions[s + 1]["chunk"]]  # batch s crosses
    assert len(epochs) >= 3 and straddles, (epochs, straddles)
    later_chunk = [s for s, p in enumerate(positions) if p["chunk"] == 1 and p["offset"]][0]  # the source's state
    for step in (3, straddles[0], later_chunk, [s for s, p in enumerate(positions) if p["epoch"] == 1][1]):
        resumed = StreamBatches(cfg, tok, chunk_docs=50)
        resumed.seek(positions[step], step)
        assert [rows(resumed.global_batch(s, 8)) for s in range(step, step + 6)] == batches[step:step + 6], step
    with pytest.raises(DataError, match="data.eval_fraction=0"):
        prepare_data(cfg_for(root, small, streaming=True), tok)


def test_a_streamed_resume_of_a_checkpoint_saved_without_streaming_is_refused():
    """trainer.json without ``data_stream``: a refusal naming the key and the ways out, not a KeyError."""
    from toolkit.config import ConfigError
    from toolkit.train.trainer import stream_position
    assert stream_position({"step": 4, "data_stream": {"row": 7}}) == {"row": 7}
    with pytest.raises(ConfigError, match="step 4 was saved by a run that did not stream.*data.streaming=false"):
        stream_position({"step": 4})
