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
