"""Llama (and the base of Mistral and Qwen2): RMSNorm, SwiGLU, GQA, RoPE (default/linear/llama3)."""
from toolkit.families.base import REPLICATED, ROW, VOCAB, Check, Family, FuseGLU, FuseQKV, Rename, TorchtitanNames

FAMILY = Family(
    model_type="llama",
    config={"num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
            "num_attention_heads": "num_attention_heads", "intermediate_size": "ffn_hidden_size",
            "rms_norm_eps": "layernorm_epsilon", "attention_dropout": "attention_dropout"},
    fixed={"normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
           "add_qkv_bias": False, "hidden_dropout": 0.0},
    top=(Rename("model.embed_tokens.weight", "embedding.word_embeddings.weight", VOCAB),
         Rename("model.norm.weight", "decoder.final_layernorm.weight", REPLICATED),
         Rename("lm_head.weight", "output_layer.weight", VOCAB)),
    layer=(Rename("input_layernorm.weight", "input_layernorm.weight", REPLICATED),
           FuseQKV(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                   "self_attention.linear_qkv.weight"),
           Rename("self_attn.o_proj.weight", "self_attention.linear_proj.weight", ROW),
           Rename("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", REPLICATED),
           FuseGLU(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight"),
           Rename("mlp.down_proj.weight", "mlp.linear_fc2.weight", ROW)),
    padding_idx_field="pad_token_id",
    torchtitan=TorchtitanNames(  # torchtitan's Llama 3 (models/llama3): complex RoPE on adjacent pairs
        top={"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight", "output.weight": "lm_head.weight"},
        layer={"attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
               "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
               "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
               "attention.wq.weight": "self_attn.q_proj.weight",  # releases before the fused QKV module
               "attention.wk.weight": "self_attn.k_proj.weight",
               "attention.wv.weight": "self_attn.v_proj.weight",
               "attention.wo.weight": "self_attn.o_proj.weight",
               "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
               "feed_forward.w2.weight": "mlp.down_proj.weight",
               "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"},
        interleaved_rope=True),
    checks=(Check("attention_bias", bool, "qkv/o biases are a different family (qwen2 has qkv bias only)"),
            Check("mlp_bias", bool, "MLP biases are not in the llama table"),
            Check("pretraining_tp", lambda v: v not in (None, 1), "set pretraining_tp=1 (same weights)")),
)

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
            rope_theta=5000.0, tie_word_embeddings=False, pad_token_id=0,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
"""The tiny test config (``toolkit/families/tiny.py``): GQA, untied, llama3 RoPE, vocab 250 (not a multiple of
128 * tp)."""
