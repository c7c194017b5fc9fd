"""Qwen3: Llama's table plus per-head RMSNorm of queries and keys (``q_norm``/``k_norm``, over
head_dim, before RoPE: megatron's ``qk_layernorm``); no qkv bias; head_dim is the config's own
(Qwen3-0.6B: hidden 1024, 16 heads of 128); often tied embeddings."""
from toolkit.families.base import REPLICATED, Check, Rename
from toolkit.families.llama import FAMILY as LLAMA

FAMILY = LLAMA.extend(
    model_type="qwen3",
    fixed={"qk_layernorm": True},
    layer=(Rename("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", REPLICATED),
           Rename("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", REPLICATED)),
    checks=(Check("use_sliding_window", bool, "set use_sliding_window=false or use backend=deepspeed"),),
)
