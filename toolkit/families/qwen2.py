"""Qwen2: Llama's table plus q/k/v biases (no o_proj bias); often tied embeddings."""
from toolkit.families.base import Check, FuseQKV
from toolkit.families.llama import FAMILY as LLAMA

FAMILY = LLAMA.extend(
    model_type="qwen2",
    fixed={"add_qkv_bias": True},
    layer=(FuseQKV(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                   "self_attention.linear_qkv.bias"),),
    checks=(Check("use_sliding_window", bool, "set use_sliding_window=false or use backend=deepspeed"),),
)
# Qwen2 has no attention_bias/mlp_bias fields to check; llama's checks read None there and pass.

TINY = dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
            tie_word_embeddings=True, use_sliding_window=False, pad_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): q/k/v biases, tied embeddings."""
