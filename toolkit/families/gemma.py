"""Gemma: Llama's table (GQA, RoPE, gated MLP) with three differences in the computation, none in
the weights: the embedding lookup is multiplied by sqrt(hidden) (in the weights' dtype), RMSNorm
scales by (1 + w) in fp32 (megatron's ``layernorm_zero_centered_gamma``: the weights are stored
as HF stores them), and the MLP's activation is GeLU with the tanh approximation. Embeddings are
usually tied; head_dim is the config's own (256 in the published models)."""
from toolkit.families.llama import FAMILY as LLAMA

FAMILY = LLAMA.extend(
    model_type="gemma",
    fixed={"layernorm_zero_centered_gamma": True},
    embedding_scale=lambda c: c.hidden_size ** 0.5,
)

TINY = dict(model_type="gemma", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
            max_position_embeddings=64, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
            pad_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): sqrt(hidden)-scaled embedding, (1 + w) RMSNorm, gated
GeLU-tanh, tied, head_dim 32."""
