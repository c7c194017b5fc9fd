"""Preference accuracy of a model on held-out pairs: the share of pairs whose chosen answer the model
finds more likely than the rejected one (sum of the answer's token log-probabilities given the prompt,
EOS included, as DPO scores answers), and the mean margin between the two. Run it on the starting
model and on the DPO-trained one:

    python examples/dpo/evaluate.py runs/demo/hf_final runs/dpo/hf_final

Each argument is a ``save_pretrained`` directory with its tokenizer (``toolkit train`` writes both to
RUN_DIR/hf_final). Prompt and answer are tokenized as TRL's ``DPOTrainer`` (and the toolkit's
``data.template: preference``) tokenize text pairs: prompt, and prompt + answer + EOS, the answer
starting where the two token sequences stop agreeing.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

EVAL = Path(__file__).parent / "eval.jsonl"


def answer_logp(model, tok, prompt: str, answer: str) -> float:
    prompt_ids = tok(prompt)["input_ids"]
    full = tok(prompt + answer + tok.eos_token)["input_ids"]
    start = next((i for i, (a, b) in enumerate(zip(prompt_ids, full)) if a != b), min(len(prompt_ids), len(full)))
    ids = torch.tensor([full])
    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logps.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return picked[start - 1:].sum().item()


def preference(model_dir: str, pairs: list[dict]) -> tuple[float, float]:
    """(share of pairs whose chosen answer is more likely, mean log-probability margin chosen - rejected)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    margins = [answer_logp(model, tok, p["prompt"], p["chosen"]) - answer_logp(model, tok, p["prompt"], p["rejected"])
               for p in pairs]
    return sum(m > 0 for m in margins) / len(pairs), sum(margins) / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="save_pretrained directories (e.g. RUN_DIR/hf_final)")
    parser.add_argument("--pairs", type=Path, default=EVAL)
    args = parser.parse_args()
    pairs = [json.loads(line) for line in args.pairs.read_text().splitlines()]
    for model_dir in args.models:
        accuracy, margin = preference(model_dir, pairs)
        print(f"{model_dir}: chosen preferred on {100 * accuracy:.1f}% of {len(pairs)} held-out pairs "
              f"({args.pairs}); mean log-probability margin chosen - rejected {margin:.2f} nats")


if __name__ == "__main__":
    main()
