"""Family tables: HF -> mcore -> HF is exact for every family, also through TP shards; errors are clear."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.families import (FamilyError, get_family, hf_to_mcore, mcore_to_hf, padded_vocab_size, read_shard,
                              shard, supported, unshard)

# Tiny configs of every family, shaped to exercise GQA, biases, tying and vocab padding (vocab 250
# is not a multiple of 128 * tp). Shared with the megatron parity tests.
TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
                  rope_theta=5000.0, tie_word_embeddings=False, pad_token_id=0,
                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
                    sliding_window=8, tie_word_embeddings=False, pad_token_id=0),  # < the parity tests' 16 tokens
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
                  tie_word_embeddings=True, use_sliding_window=False, pad_token_id=0),
    # head_dim 32 is not hidden / heads (16), as in published Qwen3 (hidden 1024, 16 heads of 128)
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
                  max_position_embeddings=64, tie_word_embeddings=False, use_sliding_window=False, pad_token_id=0),
    # gemma: sqrt(hidden)-scaled embedding, (1 + w) RMSNorm, gated GeLU-tanh, tied, head_dim 32
    "gemma": dict(model_type="gemma", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
                  max_position_embeddings=64, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                  pad_token_id=0),
    # phi3: fused qkv_proj and gate_up_proj in the checkpoint, a sliding window shorter than the
    # parity tests' 16 tokens
    "phi3": dict(model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
                 sliding_window=6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    # gemma2: four norms per layer, query_pre_attn_scalar, attention and final softcaps (small enough
    # to bite at these logits), a window of 6 on every other layer
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
                   max_position_embeddings=64, tie_word_embeddings=True, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=6,
                   layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=4, n_head=4, vocab_size=250, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


# Tiny MoE configs: GQA, 4 experts top-2, vocab padding; qwen2_moe with q/k/v biases, a gated shared
# expert, tied embeddings and un-normalized top-k weights (megatron's pre-softmax routing).
TINY_MOE = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
                    num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, tie_word_embeddings=False,
                    sliding_window=8),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=True,
                      pad_token_id=0),
    # qwen3_moe: q/k norms, head_dim 32 (not hidden / heads), renormalized top-k, no shared expert
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=250,
                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=0),
}


def tiny_config(family: str, **changes):
    kw = {**{**TINY, **TINY_MOE}[family], **changes}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def tiny_model(family: str, seed: int = 0, **changes):
    """A tiny seeded HF model of any family above (dense or mixture of experts)."""
    torch.manual_seed(seed)
    config = tiny_config(family, **changes)
    # HF's eager applies an attention softcap; transformers 5.17 would pick sdpa for gemma2, which drops it
    choice = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **choice)
    with torch.no_grad():  # HF inits biases and norms to constants: randomize so mix-ups show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_all_families_discovered():
    assert {"llama", "mistral", "qwen2", "gpt2"} <= set(supported())


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_exact_through_tp_shards(family, tp):
    model = tiny_model(family)
    cfg, fam = model.config, get_family(family)
    hf = model.state_dict()
    padded = padded_vocab_size(cfg.vocab_size, 128, tp)
    full = hf_to_mcore(fam, cfg, hf, padded)
    parts = {n: [shard(fam, cfg, n, t, tp, r) for r in range(tp)] for n, t in full.items()}
    for name, ps in parts.items():
        assert all(p.shape == ps[0].shape for p in ps)
    back = mcore_to_hf(fam, cfg, {n: unshard(fam, cfg, n, ps) for n, ps in parts.items()}, padded)
    assert sorted(back) == sorted(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reading_only_a_ranks_slices_equals_sharding_the_full_tensor(family, tp):
    # tp=4 needs 4 KV groups (a layout megatron accepts); gpt2 has one group per head already
    model = tiny_model(family, **({"num_key_value_heads": 4} if tp == 4 and family != "gpt2" else {}))
    cfg, fam = model.config, get_family(family)
    hf = model.state_dict()
    padded = padded_vocab_size(cfg.vocab_size, 128, tp)
    for name, full in hf_to_mcore(fam, cfg, hf, padded).items():
        for rank in range(tp):
            assert torch.equal(read_shard(fam, cfg, name, hf, padded, tp, rank),
                               shard(fam, cfg, name, full, tp, rank)), (name, rank)


def test_qkv_is_grouped_per_kv_head_and_glu_per_rank():
    model = tiny_model("llama")
    cfg, fam = model.config, get_family("llama")
    full = hf_to_mcore(fam, cfg, model.state_dict(), 256)
    att = model.model.layers[0].self_attn
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]  # [2 groups * (2 + 2) * 16, 64]
    assert torch.equal(qkv[0:32], att.q_proj.weight[0:32])      # q heads 0,1 of group 0
    assert torch.equal(qkv[32:48], att.k_proj.weight[0:16])     # k of group 0
    assert torch.equal(qkv[48:64], att.v_proj.weight[0:16])     # v of group 0
    assert torch.equal(qkv[64:96], att.q_proj.weight[32:64])    # q heads 2,3 of group 1
    fc1 = shard(fam, cfg, "decoder.layers.0.mlp.linear_fc1.weight",
                full["decoder.layers.0.mlp.linear_fc1.weight"], 2, 1)
    mlp = model.model.layers[0].mlp
    assert torch.equal(fc1, torch.cat([mlp.gate_proj.weight[48:], mlp.up_proj.weight[48:]]))


def test_vocab_padding_keeps_true_vocab():
    model = tiny_model("gpt2")
    full = hf_to_mcore(get_family("gpt2"), model.config, model.state_dict(), 256)
    emb = full["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64) and torch.equal(emb[:250], model.transformer.wte.weight)
    assert not emb[250:].any()
    assert "output_layer.weight" not in full  # tied
    assert padded_vocab_size(250, 128, 2) == 256 and padded_vocab_size(50257, 128, 8) == 51200


def test_strict_conversion_lists_unexpected_and_missing():
    model = tiny_model("llama")
    hf = dict(model.state_dict())
    hf["model.layers.0.self_attn.extra.weight"] = torch.zeros(3, 5)
    with pytest.raises(FamilyError, match=r"extra.weight': \(3, 5\)"):
        hf_to_mcore(get_family("llama"), model.config, hf, 256)
    del hf["model.layers.0.self_attn.extra.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(FamilyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_mcore(get_family("llama"), model.config, hf, 256)


def test_unsupported_model_type_lists_supported():
    with pytest.raises(FamilyError, match=r"model_type='bert'.*gpt2.*llama.*mistral.*qwen2"):
        get_family("bert")


@pytest.mark.parametrize("family,changes,field", [
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"hidden_act": "relu"}, "hidden_act"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"embd_pdrop": 0.1}, "embd_pdrop"),
    ("phi3", {"resid_pdrop": 0.1}, "resid_pdrop"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [1.0] * 8, "original_max_position_embeddings": 32}}, "longrope"),
    ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_config_fields_that_cannot_be_honoured_fail(family, changes, field):
    with pytest.raises(FamilyError, match=field):
        get_family(family).transformer_config(tiny_config(family, **changes))


def test_transformer_config_maps_gqa_and_head_dim():
    tc = get_family("llama").transformer_config(tiny_config("llama"))
    assert tc["num_query_groups"] == 2 and tc["kv_channels"] == 16 and tc["ffn_hidden_size"] == 96
    tc = get_family("gpt2").transformer_config(tiny_config("gpt2"))
    assert tc["ffn_hidden_size"] == 256 and tc["num_query_groups"] == 4 and tc["add_bias_linear"]
