"""Qwen3: Llama's table plus per-head RMSNorm of queries and keys (``q_norm``/``k_norm``, over
head_dim, before RoPE: megatron's ``qk_layernorm``); no qkv bias; head_dim is the config's own
(Qwen3-0.6B: hidden 1024, 16 heads of 128); often tied embeddings."""
from toolkit.families.base import REPLICATED, Check, LayerSpec, Rename
from toolkit.families.llama import FAMILY as LLAMA

FAMILY = LLAMA.extend(
    model_type="qwen3",
    layer_spec=LayerSpec(qk_norm="head"),
    layer=(Rename("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", REPLICATED),
           Rename("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", REPLICATED)),
    torchtitan=LLAMA.torchtitan.extend(  # torchtitan's Qwen 3 (models/qwen3): HF's rotate-half RoPE
        layer={"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"},
        interleaved_rope=False),
    checks=(Check("use_sliding_window", bool, "set use_sliding_window=false or use backend=deepspeed"),),
)

TINY = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
            max_position_embeddings=64, tie_word_embeddings=False, use_sliding_window=False, pad_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): head_dim 32 is not hidden / heads (16), as in published
Qwen3 (hidden 1024, 16 heads of 128)."""
