"""Phi-3: Llama's computation with the HF checkpoint's projections fused, ``qkv_proj`` = [q; k; v]
rows and ``gate_up_proj`` = [gate; up] rows, and a sliding window over every layer where the config
sets one (the toolkit's core attention keeps keys at distance < window, as HF's mask does)."""
from toolkit.families.base import ROW, Check, FuseGLU, FuseQKV, Rename
from toolkit.families.llama import FAMILY as LLAMA
from toolkit.families.mistral import every_layer_window


def _partial_rotary(c) -> float:
    return (getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor",
                                                           getattr(c, "partial_rotary_factor", 1.0))


FAMILY = LLAMA.extend(
    model_type="phi3",
    layer=(FuseQKV(("self_attn.qkv_proj.weight",), "self_attention.linear_qkv.weight"),
           Rename("self_attn.o_proj.weight", "self_attention.linear_proj.weight", ROW),
           FuseGLU(("mlp.gate_up_proj.weight",), "mlp.linear_fc1.weight"),
           Rename("mlp.down_proj.weight", "mlp.linear_fc2.weight", ROW)),
    windows=every_layer_window,
    checks=(Check("resid_pdrop", bool, "megatron drops the embedding output at the hidden-state rate too and "
                  "HF Phi-3 does not: set resid_pdrop=0 for the megatron path or use backend=deepspeed"),
            Check("partial_rotary_factor", lambda v, c: _partial_rotary(c) != 1.0,
                  "RoPE on part of each head is not in the megatron path; use backend=deepspeed", needs_config=True)),
)

TINY = dict(model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
            sliding_window=6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): fused qkv_proj and gate_up_proj in the checkpoint, a
sliding window shorter than the parity tests' 16 tokens."""
