"""Write the instruct example's data: train.jsonl and the held-out eval.jsonl (both committed).

Task: give the opposite of each of four words, in order:

    prompt:   "Give the opposite of each word: open first client high"
    response: "Opposites: close last server low"

The words come from PAIRS (21 antonym pairs, both directions), so the model has to learn the
pairs and where in the prompt each word sits; a random model scores 0%, and the demo's 4-layer,
hidden-128 Llama answered all 200 held-out prompts right after 800 steps (see README.md). Eval
word lists never occur in train, so exact match measures the rule, not memory of whole examples.
(Two tasks were tried first and dropped as too slow for a demo: reversing a list of 3-6 words
stayed at 0% after 800 steps, copying one reached 50-60%.)

    python examples/instruct/make_data.py          # rewrites both files identically (seed 0)
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Each word, with its leading space, is one token of the demo tokenizer, and every word is preceded
# by a space in prompt and response alike (hence the "Opposites:" lead-in): a word is always the
# same single token, and the k-th answer sits a fixed distance after the k-th question word.
PAIRS = [("open", "close"), ("read", "write"), ("first", "last"), ("true", "false"), ("get", "set"),
         ("start", "stop"), ("begin", "end"), ("min", "max"), ("input", "output"), ("left", "right"),
         ("on", "off"), ("before", "after"), ("client", "server"), ("in", "out"), ("high", "low"),
         ("next", "previous"), ("local", "global"), ("positive", "negative"), ("valid", "invalid"),
         ("parent", "child"), ("source", "target")]
OPPOSITE = {a: b for a, b in PAIRS} | {b: a for a, b in PAIRS}
NUM_WORDS = 4
PROMPT = "Give the opposite of each word: {words}"
RESPONSE = "Opposites: {words}"


def example(words: tuple[str, ...]) -> dict[str, str]:
    return {"prompt": PROMPT.format(words=" ".join(words)),
            "response": RESPONSE.format(words=" ".join(OPPOSITE[w] for w in words))}


def sample_lists(rng: random.Random, count: int, exclude: set[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """``count`` distinct word lists not in ``exclude``."""
    words = sorted(OPPOSITE)
    out: dict[tuple[str, ...], None] = {}
    while len(out) < count:
        picked = tuple(rng.choice(words) for _ in range(NUM_WORDS))
        if picked not in exclude:
            out[picked] = None
    return list(out)


def write_jsonl(path: Path, lists: list[tuple[str, ...]]) -> None:
    path.write_text("".join(json.dumps(example(w)) + "\n" for w in lists))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    held_out = sample_lists(rng, args.eval, exclude=set())
    train = sample_lists(rng, args.train, exclude=set(held_out))
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "eval.jsonl", held_out)
    print(f"wrote {len(train)} train and {len(held_out)} held-out examples to {args.out}")


if __name__ == "__main__":
    main()
