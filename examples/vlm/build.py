"""Write a tiny random vision-language model with its processor, offline: ``python examples/vlm/build.py OUT
--family qwen2_5_vl|qwen2_vl|llava``. The text model is 64 wide with 2 layers, the vision tower 32 wide with 2
layers; the tokenizer is the toolkit's demo BPE plus the model's special tokens, the chat template the
model's own (Qwen2.5-VL's from the hub, LLaVA-1.5's in llava-hf's form; ``templates/``)."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

TEMPLATES = Path(__file__).resolve().parent / "templates"
QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _tokenizer(extra: list[str]):
    from toolkit.data.tokenizer import _demo_tokenizer
    tok = _demo_tokenizer(512)
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def build_qwen2_5_vl(out: Path, seed: int = 0):
    """Qwen2.5-VL: tied embeddings, 2 KV heads, M-RoPE sections [2, 3, 3]; vision: windowed + one full block."""
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1])
    return _build_qwen(out, "qwen2_5_vl", vision, tied=True, seed=seed)


def build_qwen2_vl(out: Path, seed: int = 0):
    """Qwen2-VL: Qwen2.5-VL's layout (M-RoPE, 2x2 patch merger) with a plain vision transformer (no windows),
    its tower 32 wide (``embed_dim``; its ``hidden_size`` is the merger's output, the language model's width)."""
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    return _build_qwen(out, "qwen2_vl", vision, tied=False, seed=seed)


def _build_qwen(out: Path, model_type: str, vision: dict, tied: bool, seed: int):
    """The Qwen-VL text model (64 wide, 2 layers, 2 KV heads, M-RoPE), its image processor (56-112 px) and
    Qwen2.5-VL's hub chat template (Qwen2-VL's is the same) around ``vision``."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tok = _tokenizer(QWEN_TOKENS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=len(tok) + 3, max_position_embeddings=512, tie_word_embeddings=tied,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=0, eos_token_id=ids["<|im_end|>"], pad_token_id=0)
    cfg = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, tie_word_embeddings=tied,
                               image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                               eos_token_id=ids["<|im_end|>"], pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (TEMPLATES / "qwen2_5_vl.jinja").read_text()
    tok.save_pretrained(out)
    return model


def build_llava(out: Path, seed: int = 0):
    """LLaVA-1.5 shape: llama text (untied, one KV head, head_dim 32 != 64 / 4) + CLIP vision (56 px, 16 patches),
    features from the last-but-one vision layer (the last one never runs)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    tok = _tokenizer(["<image>"])
    text = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=32, vocab_size=len(tok) + 5, max_position_embeddings=1024,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32)
    cfg = AutoConfig.for_model("llava", text_config=text, vision_config=vision,
                               image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                               vision_feature_select_strategy="default", projector_hidden_act="gelu", pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    images = LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                   chat_template=(TEMPLATES / "llava.jinja").read_text(), num_additional_image_tokens=1).save_pretrained(out)
    return model


FAMILIES = {"qwen2_5_vl": build_qwen2_5_vl, "qwen2_vl": build_qwen2_vl, "llava": build_llava}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    model = FAMILIES[args.family](args.out, args.seed)
    print(f"{args.out}: {args.family}, {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()
