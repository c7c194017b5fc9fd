"""Qwen2-MoE: Qwen2's attention (q/k/v biases); each layer's MLP is a top-k routed mixture of SwiGLU
experts plus a shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))``.

Router: softmax over all experts, then the top k, renormalized only with ``norm_topk_prob``
(megatron: ``moe_router_pre_softmax`` = not ``norm_topk_prob``).
"""
from toolkit.families.base import REPLICATED, ROW, Check, FuseGLU, Packed, Rename
from toolkit.families.qwen2 import FAMILY as QWEN2

FAMILY = QWEN2.extend(
    model_type="qwen2_moe",
    drop=("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"),
    config={"num_experts": "num_moe_experts", "num_experts_per_tok": "moe_router_topk",
            "moe_intermediate_size": "moe_ffn_hidden_size",
            "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size"},
    fixed={"moe_shared_expert_gate": True},
    derived={"moe_router_pre_softmax": lambda c: not c.norm_topk_prob},
    layer=(Rename("mlp.gate.weight", "mlp.router.weight", REPLICATED),
           FuseGLU(("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                   "mlp.shared_experts.linear_fc1.weight"),
           Rename("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", ROW),
           Rename("mlp.shared_expert_gate.weight", "mlp.shared_experts.gate_weight", REPLICATED)),
    experts=(FuseGLU(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                     "mlp.experts.local_experts.{e}.linear_fc1.weight"),
             Rename("mlp.experts.{e}.down_proj.weight", "mlp.experts.local_experts.{e}.linear_fc2.weight", ROW)),
    num_experts_field="num_experts",
    packed=(Packed("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                   per_expert=True),
            Packed("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",), per_expert=True)),
    checks=(Check("qkv_bias", lambda v: v is False, "the megatron table has q/k/v biases, this model has none; "
                  "use backend=deepspeed"),
            Check("decoder_sparse_step", lambda v: v not in (None, 1), "every layer must be a MoE layer "
                  "(decoder_sparse_step=1) on the megatron path; use backend=deepspeed"),
            Check("mlp_only_layers", bool, "every layer must be a MoE layer (mlp_only_layers=[]) on the megatron "
                  "path; use backend=deepspeed")),
)

TINY = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=True,
            pad_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): q/k/v biases, a gated shared expert, tied embeddings and
un-normalized top-k weights (megatron's pre-softmax routing), 4 experts top-2."""
