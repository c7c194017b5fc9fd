"""Write the DPO example's preference pairs: train.jsonl and the held-out eval.jsonl.

Task: continue a sentence of the demo corpus (``toolkit/demo/corpus.txt``, one docstring paragraph
a line). Each pair comes from one line:

    prompt:   the line's first PROMPT_WORDS words       "Return the value of the named attribute"
    chosen:   the next ANSWER_WORDS words, as written   " of an object, or the default"
    rejected: the same words shuffled                   " the or object, default of an"

Both answers hold the same words, so only their order tells them apart: the text the corpus holds
against word salad. A model pretrained or fine-tuned on the corpus prefers the chosen answer more
often than chance; a random one does not. Answers start with a space, so prompt + chosen is the
corpus text itself and every word keeps its leading-space token of the demo tokenizer. Eval pairs
come from lines no train pair uses. ``--form chat`` writes TRL's conversational form instead
(prompt: a user message, answers: an assistant message each).

    python examples/dpo/make_pairs.py              # rewrites both files identically (seed 0)
    python examples/dpo/make_pairs.py --form chat --out /tmp/pairs

From Python (the example's tests): ``make_pairs(count, seed=...)`` gives the rows,
``write_pairs(out_dir, ...)`` the two files.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "toolkit" / "demo" / "corpus.txt"
PROMPT_WORDS = 8
ANSWER_WORDS = 6
CHAT_PROMPT = "Continue the text: {prompt}"


def corpus_lines(corpus: Path = CORPUS, min_words: int = PROMPT_WORDS + ANSWER_WORDS) -> list[list[str]]:
    """The corpus lines (as word lists) long enough for a prompt and an answer whose words are not
    all the same (a shuffle must change the order), in file order."""
    lines = [line.split() for line in corpus.read_text().splitlines()]
    return [w for w in lines if len(w) >= min_words and len(set(w[PROMPT_WORDS:min_words])) > 1]


def pair(words: list[str], rng: random.Random, form: str = "text", prompt_words: int = PROMPT_WORDS,
         answer_words: int = ANSWER_WORDS) -> dict:
    """One preference row from a line's words: the true continuation against the same words shuffled."""
    prompt, answer = words[:prompt_words], words[prompt_words:prompt_words + answer_words]
    shuffled = answer[:]
    while shuffled == answer:
        rng.shuffle(shuffled)
    prompt_text, chosen, rejected = " ".join(prompt), " ".join(answer), " ".join(shuffled)
    if form == "chat":
        return {"prompt": [{"role": "user", "content": CHAT_PROMPT.format(prompt=prompt_text)}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}]}
    if form != "text":
        raise ValueError(f"form={form!r}: use 'text' or 'chat'")
    return {"prompt": prompt_text, "chosen": " " + chosen, "rejected": " " + rejected}


def make_pairs(count: int, seed: int = 0, form: str = "text", held_out: int = 0,
               corpus: Path = CORPUS) -> tuple[list[dict], list[dict]]:
    """(``count`` train rows, ``held_out`` eval rows) from distinct corpus lines chosen by ``seed``;
    no line gives both a train and an eval row. Raises ValueError when the corpus has too few lines."""
    lines = corpus_lines(corpus)
    if count + held_out > len(lines):
        raise ValueError(f"{count} train + {held_out} eval pairs need as many corpus lines; {corpus} has "
                         f"{len(lines)} long enough")
    rng = random.Random(seed)
    order = rng.sample(range(len(lines)), count + held_out)
    rows = [pair(lines[i], rng, form) for i in order]
    return rows[held_out:], rows[:held_out]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_pairs(out: Path, train: int = 2000, held_out: int = 200, seed: int = 0,
                form: str = "text") -> tuple[Path, Path]:
    """Write ``out/train.jsonl`` and ``out/eval.jsonl``; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_rows, eval_rows = make_pairs(train, seed, form, held_out)
    return write_jsonl(out / "train.jsonl", train_rows), write_jsonl(out / "eval.jsonl", eval_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--form", choices=["text", "chat"], default="text")
    args = parser.parse_args()
    train, evals = write_pairs(args.out, args.train, args.eval, args.seed, args.form)
    print(f"wrote {args.train} train pairs to {train} and {args.eval} held-out pairs to {evals}")


if __name__ == "__main__":
    main()
