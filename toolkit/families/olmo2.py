"""OLMo 2: Llama's projections (GQA, RoPE, SwiGLU, untied) in another layer structure: no norm before
the attention or the MLP, an RMSNorm on each sublayer's output before the residual add
(``post_attention_layernorm``, ``post_feedforward_layernorm``), and q/k RMSNorm over all heads' width
(``q_norm [heads * d]``, ``k_norm [kv_heads * d]``) on the projections' outputs, before the split into
heads and RoPE. The norms multiply by the weight in fp32 (``Olmo2RMSNorm``)."""
from toolkit.families.base import COLUMN, REPLICATED, LayerSpec, Rename
from toolkit.families.llama import FAMILY as LLAMA

FAMILY = LLAMA.extend(
    model_type="olmo2",
    drop=("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    layer=(Rename("post_attention_layernorm.weight", "self_attention.linear_proj.post_norm.weight", REPLICATED),
           Rename("post_feedforward_layernorm.weight", "mlp.linear_fc2.post_norm.weight", REPLICATED),
           # full width: rank r holds the norm weights of its own heads (its KV groups' q heads, its k heads)
           Rename("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", COLUMN),
           Rename("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", COLUMN)),
    layer_spec=LayerSpec(pre_norms=False, post_norms=True, qk_norm="full"),
)

TINY = dict(model_type="olmo2", hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=250, max_position_embeddings=64, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): GQA (the k norm narrower than the q norm),
a vocabulary that is not a multiple of 128 * tp."""
