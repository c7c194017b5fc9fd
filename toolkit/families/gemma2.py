"""Gemma 2: Gemma (sqrt(hidden)-scaled embedding, (1 + w) RMSNorm, gated GeLU-tanh, tied) plus a norm
after the attention's and after the MLP's output (four norms per layer), attention logits scaled by
``query_pre_attn_scalar`` and softcapped, final logits softcapped, and a sliding window on the layers
``layer_types`` marks ``sliding_attention``. All of it runs in the toolkit's core attention and
layer spec; megatron's local attention has no softcap or window and is refused."""
from toolkit.families.base import REPLICATED, LayerSpec, Rename
from toolkit.families.gemma import FAMILY as GEMMA


def _windows(c) -> tuple:
    return tuple(c.sliding_window if t == "sliding_attention" else None for t in (c.layer_types or ()))


FAMILY = GEMMA.extend(
    model_type="gemma2",
    derived={"softmax_scale": lambda c: c.query_pre_attn_scalar ** -0.5},
    activation_field="hidden_activation",
    layer=(Rename("pre_feedforward_layernorm.weight", "pre_mlp_layernorm.weight", REPLICATED),
           Rename("post_attention_layernorm.weight", "self_attention.linear_proj.post_norm.weight", REPLICATED),
           Rename("post_feedforward_layernorm.weight", "mlp.linear_fc2.post_norm.weight", REPLICATED)),
    windows=_windows,
    attention_softcap=lambda c: c.attn_logit_softcapping,
    logit_softcap=lambda c: c.final_logit_softcapping,
    layer_spec=LayerSpec(post_norms=True),
)

TINY = dict(model_type="gemma2", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
            max_position_embeddings=64, tie_word_embeddings=True, query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): four norms per layer, query_pre_attn_scalar, attention
and final softcaps (small enough to bite at these logits), a window of 6 on every other layer."""
