"""Mixtral: Llama's attention and norms (Mistral's sliding window, where set); each layer's MLP is a
top-k routed mixture of SwiGLU experts.

Router: softmax over all experts, the top k renormalized to sum to 1 (megatron: top-k of the logits,
then softmax over them, ``moe_router_pre_softmax=False``: the same numbers).
"""
from toolkit.families.base import REPLICATED, ROW, Check, FuseGLU, Packed, Rename
from toolkit.families.llama import FAMILY as LLAMA
from toolkit.families.mistral import every_layer_window

FAMILY = LLAMA.extend(
    model_type="mixtral",
    drop=("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"),
    config={"num_local_experts": "num_moe_experts", "num_experts_per_tok": "moe_router_topk"},
    fixed={"moe_router_pre_softmax": False},
    derived={"moe_ffn_hidden_size": lambda c: c.intermediate_size},  # every expert is the dense MLP's size
    layer=(Rename("block_sparse_moe.gate.weight", "mlp.router.weight", REPLICATED),),
    experts=(FuseGLU(("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
                     "mlp.experts.local_experts.{e}.linear_fc1.weight"),
             Rename("block_sparse_moe.experts.{e}.w2.weight", "mlp.experts.local_experts.{e}.linear_fc2.weight", ROW)),
    num_experts_field="num_local_experts",
    packed=(Packed("mlp.gate.weight", ("block_sparse_moe.gate.weight",)),
            Packed("mlp.experts.gate_up_proj", ("block_sparse_moe.experts.{e}.w1.weight",
                                                "block_sparse_moe.experts.{e}.w3.weight"), per_expert=True),
            Packed("mlp.experts.down_proj", ("block_sparse_moe.experts.{e}.w2.weight",), per_expert=True)),
    windows=every_layer_window,
    checks=(Check("router_jitter_noise", bool, "set router_jitter_noise=0 (megatron jitters only the router input) "
                  "or use backend=deepspeed"),),
)

TINY = dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
            num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, tie_word_embeddings=False,
            sliding_window=8)
"""The tiny test config (``toolkit/families/tiny.py``): GQA, 4 experts top-2, vocab padding, a sliding window of
8."""
