"""Instruction data whose samples carry very different numbers of loss tokens, and runs on it.

The loss contract (README, "What a run guarantees") says the loss is the mean over all valid tokens
of the global batch. On data where every micro-batch holds the same number of valid tokens (the
demo text: all of them) a mean per micro-batch or per DP rank gives the same number, so such data
cannot catch those bugs. Here answers are either one word after a long prompt (a packed sample holds
a handful of loss tokens) or a paragraph after a short prompt (every token of the sample carries
loss), so micro-batches and DP ranks hold very different counts (``check_uneven`` asserts it).

Reusable: ``UnevenRuns.get(mode)`` trains one named ``RunMode`` once per session; a mode is any set
of overrides (backend, layout, micro-batch size, and later packing modes) on the same data.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from toolkit.config import DEMO_DIR

SEED = 23  # with train.seed 1234: DP halves differ 1.43x-2.09x in steps 1-4, samples 10.7x-16x
DOCUMENTS = 240


@dataclass(frozen=True)
class RunMode:
    name: str
    overrides: tuple[str, ...] = ()
    nproc: int = 2


STEPS = 4
BASE = ("data.seq_len=32", f"train.steps={STEPS}", "train.global_batch_size=8", "train.warmup_steps=2",
        "train.eval_every=0", "checkpoint.every=100", "train.log_every=1", "data.format=json",
        "data.template=instruction", "data.prompt_column=prompt", "data.response_column=response",
        "data.packing=concat")
REFERENCE = RunMode("reference", ("zero.stage=0", "train.micro_batch_size=8"), nproc=1)
"""One process, the whole global batch of 8 in one micro-batch: no accumulation, no DP."""
MODES = {m.name: m for m in [
    REFERENCE,
    *(RunMode(f"zero{s}_dp2_micro1", (f"zero.stage={s}", "train.micro_batch_size=1")) for s in range(4)),
    RunMode("megatron_dp2_micro1", ("backend=megatron", "train.micro_batch_size=1")),
    RunMode("megatron_tp2_micro1", ("backend=megatron", "megatron.tp=2", "train.micro_batch_size=1")),
    RunMode("megatron_pp2_micro1", ("backend=megatron", "megatron.pp=2", "train.micro_batch_size=1")),
]}
PACKED_BY_DOCUMENTS = ("data.packing=documents",)
"""Rows of whole documents (long prompts split at seq_len): per-row loss tokens stay uneven."""
DOCUMENTS_REFERENCE = RunMode("documents_reference", (*REFERENCE.overrides, *PACKED_BY_DOCUMENTS), nproc=1)
MODES |= {m.name: m for m in [DOCUMENTS_REFERENCE, *(
    RunMode(f"documents_{name}", (*MODES[name].overrides, *PACKED_BY_DOCUMENTS))
    for name in ("zero3_dp2_micro1", "megatron_tp2_micro1", "megatron_pp2_micro1"))]}


def reference_of(mode: str) -> RunMode:
    """The one-process run on the same rows as ``mode``."""
    return DOCUMENTS_REFERENCE if mode.startswith("documents_") else REFERENCE


def _words() -> list[str]:
    text = (DEMO_DIR / "corpus.txt").read_text()
    return [w for w in text.split() if w.isalpha()][:20000]


def write_uneven_data(path: Path, documents: int = DOCUMENTS, seed: int = SEED) -> Path:
    """JSONL rows with ``prompt``/``response`` (template instruction) and the same turns as
    ``messages`` (template chat): half one-word answers to 40-70-word prompts, half 40-90-word
    answers to 3-word prompts, shuffled."""
    rng, words = random.Random(seed), _words()

    def span(n: int) -> str:
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])
    rows = []
    for i in range(documents):
        if i % 2:
            prompt, response = "Answer in one word: " + span(rng.randint(40, 70)), span(1)
        else:
            prompt, response = "Explain " + span(3), span(rng.randint(40, 90))
        rows.append({"prompt": prompt, "response": response,
                     "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]})
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def loss_token_counts(data_path: Path, data_cache: Path, *overrides: str, steps: int = STEPS) -> list[list[int]]:
    """Valid (loss) tokens of each sample of global batches 0..steps-1, in global-batch order, as
    the trainer's data pipeline packs and orders them."""
    from toolkit.config import load_config
    from toolkit.data import count_loss_tokens, global_batch_indices, load_tokenizer, prepare_data
    cfg = load_config(None, [*BASE, f"data.path={data_path}", f"data.cache_dir={data_cache}", *overrides])
    data = prepare_data(cfg, load_tokenizer(cfg))
    t = cfg.train
    batches = [global_batch_indices(len(data.train), t.global_batch_size, t.seed, s) for s in range(steps)]
    return [[count_loss_tokens(data.train, [i]) for i in b] for b in batches]


class UnevenRuns:
    """Each ``RunMode`` trained once (``toolkit train`` on the uneven data) and kept by name."""

    def __init__(self, root: Path, data_cache: Path):
        self.root, self.data_cache = root, data_cache
        self.data = write_uneven_data(root / "uneven.jsonl")
        self._done: dict[str, Path] = {}

    def get(self, mode: RunMode | str) -> Path:
        from tests.helpers.runs import train
        mode = MODES[mode] if isinstance(mode, str) else mode
        if mode.name not in self._done:
            run_dir = self.root / mode.name
            train(run_dir, self.data_cache, *BASE, f"data.path={self.data}", *mode.overrides, nproc=mode.nproc,
                  base=[])
            self._done[mode.name] = run_dir
        return self._done[mode.name]


def check_uneven(counts: list[list[int]], spread: float = 8, halves: float = 1.4, every_step: bool = True) -> None:
    """The data must make the bugs visible: in every global batch, samples (micro-batches of 1)
    range over at least ``spread`` x in valid tokens, and the two DP halves differ by at least
    ``halves`` x in every step (or one: packing by documents fills rows, so it is less uneven)."""
    ratios = []
    for step, batch in enumerate(counts):
        assert min(batch) > 0 and max(batch) >= spread * min(batch), (step, batch)
        low, high = sorted((sum(batch[:len(batch) // 2]), sum(batch[len(batch) // 2:])))
        ratios.append(high / low)
    assert (min(ratios) if every_step else max(ratios)) >= halves, (ratios, counts)
