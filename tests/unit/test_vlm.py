"""Vision-language models (``docs/vlm.md``): documents against the model's own processor and TRL's assistant
mask, bad rows and configs refused naming the row or key and the fix, the plan's spec, LoRA targets and
freezing, seeded random init. The tiny models: ``tiny_vlms`` (``examples/vlm/build.py``)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from toolkit.config import ConfigError, validate
from toolkit.data.base import DataError

TRL_QWEN_TRAINING = Path(__import__("trl").__file__).parent / "chat_templates" / "qwen2_5_vl_training.jinja"
# LLaVA-1.5's template (examples/vlm/templates/llava.jinja) with TRL's {% generation %} marks on the answer
LLAVA_TRAINING = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ':'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ ' ' }}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ ' ' }}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def _cfg(model_dir, rows, tmp_path, **sections):
    raw = {"backend": "deepspeed",
           "model": {"name_or_path": str(model_dir), "init": "pretrained"},
           "data": {"path": str(rows), "format": "json", "template": "chat", "seq_len": 192, "eval_fraction": 0.0,
                    "cache_dir": str(tmp_path / "cache")},
           "train": {"global_batch_size": 2, "micro_batch_size": 1}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return validate(raw)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tokens(model_dir):
    from transformers import AutoConfig

    from toolkit.data.vision import Tokens, load_processor
    from toolkit.families.vision import find_vision
    config = AutoConfig.from_pretrained(model_dir)
    return Tokens(load_processor(str(model_dir)), config, find_vision(config.model_type))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "llava"])
def test_documents_match_the_processor_and_trl_assistant_mask(tiny_vlms, tmp_path, family):
    """ids == the processor's own (tokenized whole: LLaVA's ' A' merges across the turn boundary), loss flags
    == TRL's assistant mask from a generation-tagged template, on one- and two-image and multi-turn rows."""
    from toolkit.data.vision import _base_dir, document, open_image
    rows_path = tiny_vlms["rows"]
    cfg = _cfg(tiny_vlms[family], rows_path, tmp_path)
    tokens, base = _tokens(tiny_vlms[family]), _base_dir(cfg)
    template = LLAVA_TRAINING if family == "llava" else TRL_QWEN_TRAINING.read_text()
    for index, row in enumerate(_rows(rows_path)[:8]):
        doc = document(row, index, cfg, tokens, base)
        images = [open_image({"path": str(base / p), "bytes": None}, cfg, index, k) for k, p in enumerate(row["images"])]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = tokens.processor.apply_chat_template(
                row["messages"], chat_template=template, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True, images=images, return_tensors="pt")
            plain = tokens.processor(text=[tokens.processor.apply_chat_template(row["messages"])], images=images,
                                     return_tensors="pt")
        assert doc["ids"] == plain["input_ids"][0].tolist(), f"row {index}: ids differ from the processor's"
        assert doc["ids"] == ref["input_ids"][0].tolist(), f"row {index}: the generation template renders differently"
        assert doc["loss"] == ref["assistant_masks"][0].tolist(), f"row {index}: loss flags != TRL's assistant mask"
        assert sum(doc["loss"]) > 0 and len(doc["image_tokens"]) == len(images)
        assert sum(doc["image_tokens"]) == int((plain["input_ids"][0] == tokens.image_id).sum())


def test_image_tokens_never_carry_loss(tiny_vlms, tmp_path):
    """An image inside an assistant turn: its image tokens and markers are not targets, its text is."""
    from toolkit.data.vision import _base_dir, document
    rows = _rows(tiny_vlms["rows"])
    row = {"messages": [rows[0]["messages"][0], {"role": "assistant", "content": [
        {"type": "text", "text": "Like this one:"}, {"type": "image"}]}], "images": rows[0]["images"] + rows[1]["images"]}
    cfg = _cfg(tiny_vlms["qwen2_5_vl"], tiny_vlms["rows"], tmp_path)
    tokens = _tokens(tiny_vlms["qwen2_5_vl"])
    doc = document(row, 0, cfg, tokens, _base_dir(cfg))
    flagged = [t for t, f in zip(doc["ids"], doc["loss"]) if f]
    assert flagged and not set(flagged) & tokens.never_targets, "an image token or marker carries loss"
    assert doc["image_tokens"][1] > 0 and doc["ids"].count(tokens.image_id) == sum(doc["image_tokens"])


def test_images_as_bytes_give_the_same_document_and_pixels(tiny_vlms, tmp_path):
    """A row's images given as the files' bytes (or datasets.Image dicts) instead of paths: the same document,
    and the micro-batch's pixels equal the processor's on the same images."""
    from PIL import Image

    from toolkit.data.vision import VisionBatches, _base_dir, document
    rows = _rows(tiny_vlms["rows"])
    row = next(r for r in rows if len(r["images"]) == 2)
    cfg = _cfg(tiny_vlms["qwen2_5_vl"], tiny_vlms["rows"], tmp_path)
    tokens, base = _tokens(tiny_vlms["qwen2_5_vl"]), _base_dir(cfg)
    raw = [(base / p).read_bytes() for p in row["images"]]
    by_path = document(row, 0, cfg, tokens, base)
    by_bytes = document({**row, "images": [raw[0], {"bytes": raw[1], "path": None}]}, 0, cfg, tokens, base)
    assert (by_bytes["ids"], by_bytes["loss"], by_bytes["image_tokens"]) == \
        (by_path["ids"], by_path["loss"], by_path["image_tokens"])
    pixels = VisionBatches(tokens.processor, tokens.image_id, cfg).pixels([by_bytes["images"]], [by_bytes["image_tokens"]])
    ref = tokens.processor.image_processor([Image.open(base / p).convert("RGB") for p in row["images"]],
                                           return_tensors="pt")
    assert torch.equal(pixels["pixel_values"], ref["pixel_values"])
    assert torch.equal(pixels["image_grid_thw"], ref["image_grid_thw"])


def _write(tmp_path, rows) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_rows_are_refused_naming_the_row_and_the_fix(tiny_vlms, tmp_path):
    from toolkit.data import prepare_data
    good = _rows(tiny_vlms["rows"])[0]
    image = str(tiny_vlms["rows"].parent / good["images"][0])
    (tmp_path / "not-an-image.png").write_text("hello, I am text")
    cases = {
        "missing": ({**good, "images": ["nowhere/missing.png"]}, "does not exist; fix the path"),
        "not an image": ({**good, "images": ["not-an-image.png"]}, "is not an image PIL can read"),
        "bytes": ({**good, "images": [{"bytes": None, "path": None}]}, "not a path or image bytes"),
        "more parts": ({**good, "images": []}, "1 image part(s) in data.messages_column='messages' but 0 image(s)"),
        "no image": ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
                      "images": []}, "has no image: every document needs one"),
    }
    for name, (bad, expected) in cases.items():
        rows = _write(tmp_path, [{**good, "images": [image]}, bad])
        cfg = _cfg(tiny_vlms["llava"], rows, tmp_path / name)
        with pytest.raises(DataError) as info:
            prepare_data(cfg, None)
        assert expected in str(info.value) and "row 1" in str(info.value), (name, str(info.value))


@pytest.mark.parametrize("sections, expected", [
    ({"data": {"packing": "concat"}}, "data.packing=concat would cut an image's tokens"),
    ({"data": {"overflow": "split"}}, "data.overflow=split would cut an image's tokens"),
    ({"data": {"template": "none"}}, "set data.template=chat"),
    ({"zero": {"tiled_mlp": True}}, "zero.tiled_mlp/tiled_loss"),
    ({"model": {"quantize": "nf4"}, "lora": {"rank": 2}}, "model.quantize=nf4"),
    ({"model": {"init": "random"}}, "model.init=random is refused"),
    ({"train": {"objective": "dpo"}, "data": {"template": "preference"}}, "preference pairs with images"),
])
def test_configs_the_vlm_path_does_not_take_are_refused(tiny_vlms, tmp_path, sections, expected):
    from toolkit.plan import build_plan
    with pytest.raises(ConfigError, match="is a vision-language model") as info:
        build_plan(_cfg(tiny_vlms["llava"], tiny_vlms["rows"], tmp_path, **sections), [1])
    assert expected in str(info.value)


def test_megatron_and_sequence_parallel_are_refused(tiny_vlms, tmp_path):
    from toolkit.plan import build_plan
    cfg = validate({"backend": "megatron", "model": {"name_or_path": str(tiny_vlms["qwen2_5_vl"])},
                    "data": {"template": "chat", "path": str(tiny_vlms["rows"])}})
    with pytest.raises(ConfigError, match="megatron path builds a GPTModel from family tables, with no vision tower"):
        build_plan(cfg, [1])
    with pytest.raises(ConfigError, match="zero.sp=2: the model merges image features"):
        build_plan(_cfg(tiny_vlms["qwen2_5_vl"], tiny_vlms["rows"], tmp_path, zero={"sp": 2}), [2])


def test_spec_lora_and_freezing(tiny_vlms, tmp_path):
    """Dimensions from the text config; tower and projector counted apart; LoRA all-linear adapts the language
    model and the projector, never the tower; freeze_vision leaves the projector trained."""
    from toolkit.families.meta import meta_model
    from toolkit.plan import build_plan
    # LLaVA's unused: its last CLIP layer (q/k/v/o 4 x (32 x 32 + 32), fc1/fc2 32 x 48 + 48 + 48 x 32 + 32, two norms
    # 2 x 64) and post_layernorm (64) = 7568; the projector: 32 x 64 + 64 + 64 x 64 + 64 = 6272
    for family, (projector, unused) in {"qwen2_5_vl": (24800, 0), "llava": (6272, 7568)}.items():
        cfg = _cfg(tiny_vlms[family], tiny_vlms["rows"], tmp_path, lora={"rank": 2})
        plan = build_plan(cfg, [1])
        spec = plan.model
        assert (spec.layers, spec.hidden) == (2, 64) and spec.projector == projector and spec.vision_unused == unused
        model = meta_model(spec.hf_config())
        assert type(model).__name__.endswith("ForConditionalGeneration")
        assert spec.total == sum(p.numel() for p in model.parameters())
        from toolkit.lora.spec import matches
        linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        adapted = [n for n in linear if any(matches(n, t) for t in plan.lora.targets)]
        assert adapted and not [n for n in adapted if ".visual.blocks" in n or ".vision_tower." in n], adapted
        assert [n for n in adapted if "merger" in n or "multi_modal_projector" in n], "the projector gets adapters"
        with pytest.raises(ConfigError, match="vision tower, which stays frozen under LoRA"):
            build_plan(_cfg(tiny_vlms[family], tiny_vlms["rows"], tmp_path,
                            lora={"rank": 2, "target_modules": ["fc1" if family == "llava" else "qkv"]}), [1])


def test_seeded_random_init_and_what_trains(tiny_vlms, tmp_path):
    """Qwen2.5-VL at model.init=random: every parameter drawn (the same twice), the tower frozen, the projector
    trained, document attention on the language model only."""
    from toolkit.adapters.hf import build_model
    from toolkit.plan import build_plan
    plan = build_plan(_cfg(tiny_vlms["qwen2_5_vl"], tiny_vlms["rows"], tmp_path, model={"init": "random"}), [1])
    first, second = build_model(plan), build_model(plan)
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(a, b) and torch.isfinite(a).all(), name
    trained = {n for n, p in first.named_parameters() if p.requires_grad}
    assert not [n for n in trained if n.startswith("model.visual.") and ".merger." not in n]
    assert [n for n in trained if n.startswith("model.visual.merger.")]
    assert plan.trainable_parameters()[0] == sum(p.numel() for n, p in first.named_parameters() if n in trained)
    assert first.config.text_config._attn_implementation == "toolkit_documents"
    assert first.config.vision_config._attn_implementation != "toolkit_documents"


def test_memory_estimate_counts_the_tower(tiny_vlms, tmp_path):
    """The tower's weights held, not trained when frozen; its activations and pixel values at their bound (the
    formulas of toolkit/estimate/memory.py's docstring, worked by hand for the tiny Qwen2.5-VL)."""
    from toolkit.estimate.memory import memory, tower_activations
    from toolkit.plan import build_plan
    frozen = build_plan(_cfg(tiny_vlms["qwen2_5_vl"], tiny_vlms["rows"], tmp_path), [1])
    trained = build_plan(_cfg(tiny_vlms["qwen2_5_vl"], tiny_vlms["rows"], tmp_path, model={"freeze_vision": False}), [1])
    # b=1, s=192: 4 patches per image token -> 768 patches of 3 x 2 x 14 x 14 = 1176 fp32 pixel values; frozen:
    # + the projector's input, 768 x 32 x 4 bytes; trained: + 2 layers x 768 x (9 x 32 + 4 x 48) x 4 bytes
    assert tower_activations(frozen.config, frozen.model, 4, "none") == 4 * 768 * 1176 + 768 * 32 * 4
    assert tower_activations(trained.config, trained.model, 4, "none") == 4 * 768 * 1176 + 2 * 768 * (9 * 32 + 4 * 48) * 4
    lay = frozen.layout(1)
    a, b = memory(frozen.config, frozen.model, lay), memory(trained.config, trained.model, lay)
    assert a.weights == b.weights and b.gradients - a.gradients == frozen.model.vision * 4


def test_toolkit_prepare_refuses_image_rows(tiny_vlms, tmp_path):
    from toolkit.data.prepare import prepare_prefix
    with pytest.raises(DataError, match="rows carry images"):
        prepare_prefix(_cfg(tiny_vlms["llava"], tiny_vlms["rows"], tmp_path), str(tmp_path / "prefix"))
