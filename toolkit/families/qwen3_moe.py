"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no qkv bias); each layer's MLP is a top-k
routed mixture of SwiGLU experts, no shared expert.

Router: softmax over all experts, then the top k, renormalized with ``norm_topk_prob`` (the
published default; megatron: ``moe_router_pre_softmax`` = not ``norm_topk_prob``). Layers without
experts (``decoder_sparse_step`` > 1, ``mlp_only_layers``) are refused on the megatron path.
"""
from toolkit.families.base import REPLICATED, Check, Rename
from toolkit.families.qwen2_moe import FAMILY as QWEN2_MOE
from toolkit.families.qwen3 import FAMILY as QWEN3

FAMILY = QWEN3.extend(
    model_type="qwen3_moe",
    drop=("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"),
    config={"num_experts": "num_moe_experts", "num_experts_per_tok": "moe_router_topk",
            "moe_intermediate_size": "moe_ffn_hidden_size"},
    derived={"moe_router_pre_softmax": lambda c: not c.norm_topk_prob},
    layer=(Rename("mlp.gate.weight", "mlp.router.weight", REPLICATED),),
    experts=QWEN2_MOE.experts,  # the same checkpoint names per expert, packed alike by transformers 5
    num_experts_field="num_experts",
    packed=QWEN2_MOE.packed,
    checks=(Check("decoder_sparse_step", lambda v: v not in (None, 1), "every layer must be a MoE layer "
                  "(decoder_sparse_step=1) on the megatron path; use backend=deepspeed"),
            Check("mlp_only_layers", bool, "every layer must be a MoE layer (mlp_only_layers=[]) on the megatron "
                  "path; use backend=deepspeed")),
)

TINY = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
            max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): q/k norms, head_dim 32 (not hidden / heads), renormalized
top-k, no shared expert, 4 experts top-2."""
