"""Family tables: HF -> mcore -> HF is exact for every family, also through TP shards; errors are clear."""
from __future__ import annotations

import pytest
import torch

from toolkit.families import (
    FamilyError,
    get_family,
    hf_to_mcore,
    mcore_to_hf,
    padded_vocab_size,
    read_shard,
    shard,
    supported,
    unshard,
)
from toolkit.families.tiny import TINY, tiny_config, tiny_model


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
