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
