"""Gemma 2: Gemma (sqrt(hidden)-scaled embedding, (1 + w) RMSNorm, gated GeLU-tanh, tied) plus a norm
after the attention's and after the MLP's output (four norms per layer), attention logits scaled by
``query_pre_attn_scalar`` and softcapped, final logits softcapped, and a sliding window on the layers
``layer_types`` marks ``sliding_attention``. All of it runs in the toolkit's core attention and
layer spec; megatron's local attention has no softcap or window and is refused."""
from toolkit.families.base import REPLICATED, Rename
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
    post_norms=True,
)
