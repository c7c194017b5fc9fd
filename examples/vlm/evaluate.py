"""Ask a vision-language model about held-out images: ``python examples/vlm/evaluate.py MODEL_DIR EVAL_DIR``
(EVAL_DIR: written by ``examples/vlm/data.py EVAL_DIR --seed 1``). Greedy answers to each row's first question,
with transformers alone (``AutoProcessor`` + ``AutoModelForImageTextToText``; a processor whose video part needs
torchvision falls back to the toolkit's images-only build of it), and the share answered exactly."""
from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path


def load(model_dir: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
    except ImportError:  # Qwen2.5-VL's video processor needs torchvision (docs/vlm.md)
        from toolkit.compat.vlm_processor import image_only_processor
        processor = image_only_processor(model_dir)
    return processor, AutoModelForImageTextToText.from_pretrained(model_dir).eval()


def answer(processor, model, messages: list[dict], images: list) -> str:
    import torch
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def main() -> None:
    from PIL import Image
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("eval_dir", type=Path)
    parser.add_argument("--show", type=int, default=6)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    processor, model = load(args.model)
    rows = [json.loads(line) for line in (args.eval_dir / "train.jsonl").read_text().splitlines()]
    right = 0
    for i, row in enumerate(rows):
        question, truth = row["messages"][0], row["messages"][1]["content"][-1]["text"]
        images = [Image.open(args.eval_dir / p).convert("RGB") for p in row["images"]]
        got = answer(processor, model, [question], images)
        right += got == truth
        if i < args.show:
            print(f"{row['images'][0]:36s} {question['content'][-1]['text']:28s} -> {got!r} (truth {truth!r})")
    print(f"exact answers: {right}/{len(rows)}")


if __name__ == "__main__":
    main()
