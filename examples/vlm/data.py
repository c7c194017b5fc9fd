"""Write a small image-text chat set and a config that fine-tunes a tiny VLM on it: ``python examples/vlm/data.py
OUT [--model DIR] [--rows N]``. Images are PNGs drawn with PIL (a circle, square or triangle in red, green,
blue or yellow on white, of a few sizes); the questions ask for the shape, the colour, or whether two
images show the same shape (two images in one turn), with a follow-up turn in some rows. Paths in
``train.jsonl`` are relative to it."""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SIZES = ((56, 56), (70, 56), (56, 84), (84, 70))


def draw(shape: str, colour: str, size: tuple[int, int]):
    from PIL import Image, ImageDraw
    width, height = size
    image = Image.new("RGB", size, (255, 255, 255))
    pen, box = ImageDraw.Draw(image), [width * 0.2, height * 0.2, width * 0.8, height * 0.8]
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(width / 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
    return image


def _turn(role: str, text: str, images: int = 0) -> dict:
    return {"role": role, "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


def make_rows(out: Path, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows, their images written under ``out/images``."""
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows, count = [], 0

    def image(shape, colour):
        nonlocal count
        name = f"images/{count:04d}-{colour}-{shape}.png"
        draw(shape, colour, rng.choice(SIZES)).save(out / name)
        count += 1
        return name

    for i in range(n):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        kind = i % 4
        if kind == 0:
            messages = [_turn("user", "What shape is this?", 1), _turn("assistant", f"A {shape}.")]
            images = [image(shape, colour)]
        elif kind == 1:
            messages = [_turn("user", "What colour is it?", 1), _turn("assistant", f"It is {colour}.")]
            images = [image(shape, colour)]
        elif kind == 2:
            other = rng.choice(SHAPES)
            messages = [_turn("user", "Are these the same shape?", 2),
                        _turn("assistant", "Yes." if other == shape else "No.")]
            images = [image(shape, colour), image(other, rng.choice(list(COLOURS)))]
        else:
            messages = [_turn("user", "What shape is this?", 1), _turn("assistant", f"A {shape}."),
                        _turn("user", "And its colour?"), _turn("assistant", f"{colour.capitalize()}.")]
            images = [image(shape, colour)]
        rows.append({"messages": messages, "images": images})
    return rows


CONFIG = """# Fine-tune a tiny vision-language model on shapes and colours (examples/vlm/README.md).
backend: deepspeed
nproc: 2
run_dir: {run_dir}
model:
  name_or_path: {model}
  init: pretrained
  freeze_vision: false      # the tiny tower is random: let it learn too (default true: frozen)
data:
  path: {data}
  format: json
  template: chat            # messages with {{"type": "image"}} parts; images in data.images_column
  images_column: images
  packing: documents
  overflow: drop
  seq_len: 192
  eval_fraction: 0.1
train:
  steps: 150
  global_batch_size: 8
  micro_batch_size: 2
  lr: 3.0e-3
  min_lr: 3.0e-4
  warmup_steps: 10
  eval_every: 50
  log_every: 10
zero:
  stage: 2
checkpoint:
  every: 50
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="runs/vlm-model", help="the model directory examples/vlm/build.py wrote")
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = make_rows(args.out, args.rows, args.seed)
    data = args.out / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = CONFIG.format(run_dir=args.out / "run", model=args.model, data=data)
    (args.out / "config.yaml").write_text(config)
    print(f"{data}: {len(rows)} rows; {args.out / 'config.yaml'}")


if __name__ == "__main__":
    main()
