"""Data at scale as a user runs it: ``toolkit prepare`` a jsonl into a Megatron indexed dataset, train
from the prefix (same losses as from the jsonl, bit for bit), train a 0.8/0.2 blend of two prefixes (one
written by megatron-core's own builder) and resume it exactly after a kill, on ZeRO-2 dp2 and megatron
tp2 dp2."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from tests.helpers.runs import losses, resumes, run_in_process, train
from toolkit.observe.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

STEPS = ("train.steps=4", "data.eval_fraction=0.05", "train.eval_every=2")
LAYOUTS = {"zero2_dp2": (("backend=deepspeed", "zero.stage=2"), 2),
           "megatron_tp2_dp2": (("backend=megatron", "megatron.tp=2"), 4)}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, data_cache):
    """A jsonl of 600 documents, its prefix written by ``toolkit prepare`` (2 workers), and a second
    source as megatron-core's ``IndexedDatasetBuilder`` writes it (no sidecar, EOS appended)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from toolkit.config import load_config
    from toolkit.data import load_tokenizer
    root = tmp_path_factory.mktemp("data-scale")
    rng = random.Random(1)
    words = "the quick brown fox jumps over a lazy dog while seven wizards box quietly".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(600)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run_in_process(["prepare", "--set", f"data.path={root / 'docs.jsonl'}", "--set", "data.num_proc=2",
                    "--out", str(root / "docs")])
    tok = load_tokenizer(load_config(None, []))
    builder = IndexedDatasetBuilder(str(root / "mc.bin"), dtype=DType.optimal_dtype(len(tok)))
    for text in texts[::-1]:
        builder.add_item(torch.tensor(tok(text.upper(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
        builder.end_document()
    builder.finalize(str(root / "mc.idx"))
    return root


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prefix_trains_as_the_jsonl_it_came_from(layout, prepared, tmp_path, data_cache):
    overrides, nproc = LAYOUTS[layout]
    for name in ("docs.jsonl", "docs"):
        train(tmp_path / name, data_cache, *STEPS, *overrides, f"data.path={prepared / name}", nproc=nproc)
    print(f"\n{layout}: jsonl {losses(tmp_path / 'docs.jsonl')}, prefix {losses(tmp_path / 'docs')}")
    assert losses(tmp_path / "docs") == losses(tmp_path / "docs.jsonl") and len(losses(tmp_path / "docs")) == 4
    evals = [eval_losses(tmp_path / name) for name in ("docs.jsonl", "docs")]
    assert evals[0] == evals[1] and len(evals[0]) == 2


def eval_losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["eval_loss"] for r in map(json.loads, lines) if "eval_loss" in r]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_blend_realizes_its_weights_and_resumes_exactly(layout, prepared, tmp_path, data_cache):
    """0.8/0.2 of the prepared prefix and megatron's builder's prefix: tokens per source in metrics; a run
    killed at step 3 resumes from its step-2 checkpoint with the uninterrupted run's losses bit for bit."""
    overrides, nproc = LAYOUTS[layout]
    blend = (*STEPS, *overrides, f"data.path={prepared / 'docs'},{prepared / 'mc'}", "data.weights=[0.8,0.2]",
             "checkpoint.every=2")
    train(tmp_path / "whole", data_cache, *blend, nproc=nproc)
    train(tmp_path / "killed", data_cache, *blend, "restart.max_restarts=1", "restart.backoff_s=0.2",
          env={"TOOLKIT_FAULT": "kill:step=3:rank=1"}, nproc=nproc)
    assert resumes(tmp_path / "killed") == [("step_00000002", 2, "as saved")]
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")
    rows = [r for _, r in sorted(read_metrics(tmp_path / "whole").items())]
    tokens = np.array([[r["tokens_by_source"]["docs"], r["tokens_by_source"]["mc"]] for r in rows])
    print(f"\n{layout}: blend losses {losses(tmp_path / 'whole')}, tokens by source {tokens.tolist()}")
    assert len(rows) == 4 and (tokens > 0).all() and tokens[:, 0].sum() > 2 * tokens[:, 1].sum()


def test_a_stream_killed_and_resumed_trains_the_uninterrupted_tokens(prepared, tmp_path, data_cache):
    """``data.streaming``: the position saved with the step-2 checkpoint (trainer.json ``data_stream``)
    reopens the source where it was; the resumed run's losses equal the uninterrupted one's bit for bit."""
    args = ("train.steps=5", "data.eval_fraction=0", "backend=deepspeed", "zero.stage=2", "checkpoint.every=2",
            f"data.path={prepared / 'docs.jsonl'}", "data.streaming=true")
    train(tmp_path / "whole", data_cache, *args)
    train(tmp_path / "killed", data_cache, *args, "restart.max_restarts=1", "restart.backoff_s=0.2",
          env={"TOOLKIT_FAULT": "kill:step=3:rank=1"})
    assert resumes(tmp_path / "killed") == [("step_00000002", 2, "as saved")]
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole") and len(losses(tmp_path / "whole")) == 5
    saved = json.loads((tmp_path / "whole" / "checkpoints" / "step_00000004" / "trainer.json").read_text())
    assert saved["data_stream"]["offset"] == 4 * 8 and saved["data_stream"]["epoch"] == 0
