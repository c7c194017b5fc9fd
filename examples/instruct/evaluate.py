"""Exact-match accuracy of greedy generations on held-out prompts.

    python examples/instruct/evaluate.py runs/instruct/hf_final [--data examples/instruct/eval.jsonl]

Loads the model and tokenizer the trainer exported (``save_pretrained``), formats each prompt
exactly as training did (``toolkit.data.INSTRUCTION_TEMPLATE``), generates greedily until EOS and
compares the text with the reference response.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:
    from toolkit.data import INSTRUCTION_TEMPLATE
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from toolkit.data import INSTRUCTION_TEMPLATE


def load_examples(path: Path, limit: int | None) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 64,
             after_eos: bool = False) -> list[str]:
    """Greedy completions of ``prompts``, left-padded in batches (input_ids [batch, prompt_len]).
    ``after_eos``: each prompt follows an EOS, as training saw it under ``data.packing: concat``
    (``documents`` and ``pad`` start every example on its own)."""
    start = [tokenizer.eos_token_id] if after_eos else []
    tokenizer.padding_side = "left"
    out = []
    for i in range(0, len(prompts), batch_size):
        texts = [INSTRUCTION_TEMPLATE.format(prompt=p) for p in prompts[i:i + batch_size]]
        ids = [start + tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        generated = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new = generated[:, batch["input_ids"].shape[1]:]
        out += [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]
    return out


def trained_packing(model_dir: str) -> str | None:
    """``data.packing`` of the run that exported ``model_dir`` (its ``plan.json`` beside it), if known."""
    plan = Path(model_dir).parent / "plan.json"
    if not plan.is_file():
        return None
    data = json.loads(plan.read_text())["config"]["data"]
    if "packing" not in data:  # a run from before packing modes: concat
        return "concat"
    return data["packing"] or ("concat" if data["template"] == "none" else "documents")


def evaluate(model_dir: str, data: Path, limit: int | None = None, show: int = 5) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    examples = load_examples(data, limit)
    answers = generate(model, tokenizer, [e["prompt"] for e in examples], max_new_tokens=16,
                       after_eos=trained_packing(model_dir) == "concat")
    hits = [a == e["response"].strip() for a, e in zip(answers, examples)]
    for e, a, ok in list(zip(examples, answers, hits))[:show]:
        print(f"{'OK  ' if ok else 'MISS'} {e['prompt']!r} -> {a!r} (expected {e['response']!r})")
    accuracy = sum(hits) / len(hits)
    print(f"exact match: {sum(hits)}/{len(hits)} = {accuracy:.1%} on {data}")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", default="runs/instruct/hf_final",
                        help="HF model directory with the tokenizer (default: %(default)s)")
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "eval.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")
    parser.add_argument("--show", type=int, default=5, help="print this many examples")
    args = parser.parse_args()
    evaluate(args.model_dir, args.data, args.limit, args.show)


if __name__ == "__main__":
    main()
