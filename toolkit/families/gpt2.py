"""GPT-2: LayerNorm, GELU (tanh), learned positions, biases everywhere, Conv1D ([in, out]) weights,
fused ``c_attn`` = [q; k; v], tied embeddings."""
from toolkit.families.base import COLUMN, REPLICATED, ROW, VOCAB, Check, Family, FuseQKV, Rename

FAMILY = Family(
    model_type="gpt2",
    config={"n_layer": "num_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
            "layer_norm_epsilon": "layernorm_epsilon", "attn_pdrop": "attention_dropout",
            "resid_pdrop": "hidden_dropout"},
    fixed={"normalization": "LayerNorm", "gated_linear_unit": False, "add_bias_linear": True,
           "add_qkv_bias": True},
    derived={"ffn_hidden_size": lambda c: c.n_inner or 4 * c.n_embd},
    hf_layer="transformer.h.{i}.",
    position_embedding="learned_absolute",
    activation_field="activation_function",
    top=(Rename("transformer.wte.weight", "embedding.word_embeddings.weight", VOCAB),
         Rename("transformer.wpe.weight", "embedding.position_embeddings.weight", REPLICATED),
         Rename("transformer.ln_f.weight", "decoder.final_layernorm.weight", REPLICATED),
         Rename("transformer.ln_f.bias", "decoder.final_layernorm.bias", REPLICATED),
         Rename("lm_head.weight", "output_layer.weight", VOCAB)),
    layer=(Rename("ln_1.weight", "input_layernorm.weight"), Rename("ln_1.bias", "input_layernorm.bias"),
           FuseQKV(("attn.c_attn.weight",), "self_attention.linear_qkv.weight", transpose=True),
           FuseQKV(("attn.c_attn.bias",), "self_attention.linear_qkv.bias"),
           Rename("attn.c_proj.weight", "self_attention.linear_proj.weight", ROW, transpose=True),
           Rename("attn.c_proj.bias", "self_attention.linear_proj.bias", REPLICATED),
           Rename("ln_2.weight", "pre_mlp_layernorm.weight"), Rename("ln_2.bias", "pre_mlp_layernorm.bias"),
           Rename("mlp.c_fc.weight", "mlp.linear_fc1.weight", COLUMN, transpose=True),
           Rename("mlp.c_fc.bias", "mlp.linear_fc1.bias", COLUMN),
           Rename("mlp.c_proj.weight", "mlp.linear_fc2.weight", ROW, transpose=True),
           Rename("mlp.c_proj.bias", "mlp.linear_fc2.bias", REPLICATED)),
    checks=(Check("scale_attn_by_inverse_layer_idx", bool, "set it to false (megatron scales by 1/sqrt(d) only)"),
            Check("reorder_and_upcast_attn", bool, "set it to false"),
            Check("scale_attn_weights", lambda v: v is False, "set it to true"),
            Check("add_cross_attention", bool, "cross attention is not a causal LM layer"),
            Check("embd_pdrop", lambda v, c: v != c.resid_pdrop, "megatron drops embeddings with hidden_dropout "
                  "(= resid_pdrop); set embd_pdrop equal to resid_pdrop", needs_config=True)),
)

TINY = dict(model_type="gpt2", n_embd=64, n_layer=4, n_head=4, vocab_size=250, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): biases everywhere, learned positions, tied."""
