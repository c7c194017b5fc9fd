"""Mixture of experts (mixtral, qwen2_moe, qwen3_moe): family tables against transformers' own checkpoint layout,
the load-balancing loss against HF's, and the megatron path against HF's own forward on 4 ranks at
EP 1 and 2 (x DP 4), TP 2 with sequence parallelism (x DP 2, x EP 2) and PP 2 x EP 2: logits, routing and
per-parameter gradients, aux loss included. The tiny configs live beside each family (toolkit/families/, `TINY`)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import (
    assert_logits_on_every_dp_rank,
    batches,
    grad_gap,
    grad_mismatches,
    logit_gaps,
    worst_ratio,
)
from tests.helpers.ranks import run_ranks
from toolkit.adapters import moe
from toolkit.config import validate
from toolkit.families import (
    FamilyError,
    get_family,
    hf_to_mcore,
    mcore_to_hf,
    pack,
    padded_vocab_size,
    read_shard,
    shard,
    unpack,
    unshard,
)
from toolkit.families.tiny import TINY_MOE, tiny_config, tiny_model
from toolkit.loss import IGNORE_INDEX, token_loss_sum

FAMILIES = sorted(TINY_MOE)
AUX_COEFF = 0.1  # large, so a mis-scaled aux gradient shows in the router's gradients


# --- family tables (no processes) -------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_names_are_what_save_pretrained_writes(family, tmp_path):
    from safetensors.torch import load_file
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    unpacked = unpack(get_family(family), model.config, model.state_dict())
    if model.config.tie_word_embeddings:  # stored once, as the input embedding
        unpacked.pop("lm_head.weight")
    assert sorted(unpacked) == sorted(on_disk)
    assert all(torch.equal(unpacked[k], on_disk[k]) for k in on_disk)
    packed = pack(get_family(family), model.config, on_disk)
    state = {k: v for k, v in model.state_dict().items() if k in packed or k != "lm_head.weight"}
    assert sorted(packed) == sorted(state) and all(torch.equal(packed[k], state[k]) for k in state)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_exact_through_tp_shards_and_slices(family, tp):
    model = tiny_model(family)
    cfg, fam = model.config, get_family(family)
    hf = unpack(fam, cfg, model.state_dict())
    padded = padded_vocab_size(cfg.vocab_size, 128, tp)
    full = hf_to_mcore(fam, cfg, hf, padded)
    assert sum(".local_experts." in n for n in full) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    parts = {n: [shard(fam, cfg, n, t, tp, r) for r in range(tp)] for n, t in full.items()}
    for name, ps in parts.items():
        for r in range(tp):
            assert torch.equal(read_shard(fam, cfg, name, hf, padded, tp, r), ps[r]), (name, r)
    back = mcore_to_hf(fam, cfg, {n: unshard(fam, cfg, n, ps) for n, ps in parts.items()}, padded)
    expected = {k: v for k, v in hf.items() if not (fam.tied(cfg) and k == "lm_head.weight")}
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], expected.get(k, hf[k])) for k in hf)


def test_expert_glu_is_gate_then_up_per_expert():
    model = tiny_model("mixtral")
    cfg, fam = model.config, get_family("mixtral")
    full = hf_to_mcore(fam, cfg, unpack(fam, cfg, model.state_dict()), 256)
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj  # [E, 2F, H] = per expert [w1; w3]
    assert torch.equal(full["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"], gate_up[3])
    assert torch.equal(full["decoder.layers.1.mlp.router.weight"], model.model.layers[1].mlp.gate.weight)


@pytest.mark.parametrize("family,changes,field", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias=False is not supported by the megatron path; the megatron table "
                                       "has q/k/v biases"),
])
def test_config_fields_that_cannot_be_honoured_fail(family, changes, field):
    with pytest.raises(FamilyError, match=field):
        get_family(family).transformer_config(tiny_config(family, **changes))


def test_router_settings_follow_hf():
    assert get_family("mixtral").transformer_config(tiny_config("mixtral"))["moe_router_pre_softmax"] is False
    tc = get_family("qwen2_moe").transformer_config(tiny_config("qwen2_moe"))
    assert tc["moe_router_pre_softmax"] is True and tc["moe_shared_expert_gate"] is True
    assert get_family("qwen2_moe").transformer_config(tiny_config("qwen2_moe", norm_topk_prob=True))[
        "moe_router_pre_softmax"] is False


# --- the load-balancing loss ------------------------------------------------------------------------

def test_load_balancing_loss_equals_hfs_on_one_layer():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    ours = moe.load_balancing_loss(logits, moe.routed_counts(logits, 2), 64)
    assert ours.item() == pytest.approx(load_balancing_loss_func((logits,), 8, 2).item(), rel=1e-6)
    halves = [moe.load_balancing_loss(part, moe.routed_counts(logits, 2), 64) for part in logits.chunk(2)]
    assert sum(halves).item() == pytest.approx(ours.item(), rel=1e-6)  # sequence-parallel shares add up
    even = torch.zeros(8, 8)  # each token's top 2 spread evenly, uniform probabilities: aux = k
    assert moe.load_balancing_loss(even, torch.full((8,), 2), 8).item() == pytest.approx(2.0)


# --- megatron vs HF (spawned gloo ranks) ------------------------------------------------------------

LAYOUTS = {  # name: (tp, pp, ep, megatron.* extras), each on 4 ranks: dp = 4 / (tp * pp)
    "ep1_dp4": (1, 1, 1, {}),
    "ep2_dp4": (1, 1, 2, {}),  # two expert-data-parallel replicas of each expert
    "tp2_sp_dp2": (2, 1, 1, {"sequence_parallel": True}),
    "tp2_sp_ep2": (2, 1, 2, {"sequence_parallel": True}),  # TP x EP: expert tensor parallelism = tp
    "pp2_ep2": (1, 2, 2, {}),
    "ep2_dp4_local_attention": (1, 1, 2, {"attention": "local"}),  # megatron's own attention and RoPE
}
CASES = [(layout, family) for layout in sorted(LAYOUTS) for family in sorted(TINY_MOE)
         if LAYOUTS[layout][3].get("attention") != "local" or not TINY_MOE[family].get("sliding_window")]
"""Megatron's local attention has no sliding window: families with one are refused there (test_plan)."""
WORLD = 4
GRAD_RTOL = 1e-5  # per parameter, relative to its own max |grad| (as in test_megatron_parity); measured worst 1.2e-6


def hf_reference(model, micro_batches):
    """HF logits, tokens per expert and grads of sum(token losses) / tokens + coeff * mean aux."""
    model.zero_grad()
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    k = model.config.num_experts_per_tok
    logits, counts = [], 0
    for mb in micro_batches:
        out = model(input_ids=mb["input_ids"], output_router_logits=True)
        loss, _ = token_loss_sum(out.logits, mb["labels"])
        layer_counts = [moe.routed_counts(z.detach(), k) for z in out.router_logits]
        aux = sum(moe.load_balancing_loss(z, c, z.shape[0]) for z, c in zip(out.router_logits, layer_counts))
        (loss / tokens + AUX_COEFF * aux / len(out.router_logits) / len(micro_batches)).backward()
        logits.append(out.logits.detach())
        counts = counts + torch.stack(layer_counts).double()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits, counts, grads, tokens


def _rank_parity(rank, world):
    """Every layout and family in turn on these ranks (megatron's groups rebuilt for each)."""
    from tests.helpers.ranks import release_megatron
    results = {}
    for name, family in CASES:
        tp, pp, ep, extra = LAYOUTS[name]
        results[(name, family)] = _one_layout(family, tp, pp, ep, extra)
        release_megatron()
    return results


def _one_layout(family, tp, pp, ep, extra) -> dict:
    from tests.helpers.ranks import megatron_engine
    model = tiny_model(family)
    micro = batches(model.config.vocab_size, n_micro=4, mbs=1)  # dp = 2: two per rank, dp = 4: one
    ref_logits, ref_counts, ref_grads, tokens = hf_reference(model, micro)
    cfg = validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, "ep": ep, **extra},
                    "train": {"global_batch_size": 4, "micro_batch_size": 1, "moe_aux_loss_coeff": AUX_COEFF}})
    engine = megatron_engine(cfg, model)
    dp = engine.dp_size
    mine = micro[engine.dp_rank::dp]
    got = engine.logits(mine)
    engine.forward_backward(mine, tokens, complete_grads=True)  # all-reduced: whole grads to compare
    grads = engine.hf_state(attr="main_grad")
    out = {"counts": engine.router_stats.counts.clone(),  # this rank's share; summed over ranks below
           "dp": dp, "logits": logit_gaps(engine, got, ref_logits)}
    if grads is not None:
        ref = unpack(get_family(family), model.config, ref_grads)
        ref.pop("lm_head.weight", None)  # tied: the embedding's gradient
        out["grads"] = {n: grad_gap(grads[n], g) for n, g in ref.items() if n in grads}
        out["missing_grads"] = sorted(set(ref) - set(grads))
        out["ref_counts"] = ref_counts
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU/gloo parity suite")
    ranks = run_ranks(_rank_parity, WORLD, tmp_path_factory.mktemp("moe_parity"), timeout=900)
    merged = {}
    for key in ranks[0]:
        d = {"counts": sum(r[key]["counts"] for r in ranks), "logits": {}}
        for r in ranks:
            d["logits"].update(r[key]["logits"])
            d.update({k: v for k, v in r[key].items() if k not in ("counts", "logits")})
        merged[key] = d
    print("\nHF vs megatron (MoE): max |logit diff| per DP rank; worst gradient relative to its own max |grad|:")
    for (name, family), d in merged.items():
        print(f"  {name} {family}: logits {d['logits']} grads {worst_ratio(d['grads'])}")
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("layout,family", CASES)
def test_megatron_matches_hf_logits_routing_and_grads(parity, family, layout):
    d = parity[(layout, family)]
    assert_logits_on_every_dp_rank(d)
    assert torch.equal(d["counts"], d["ref_counts"]), "routing decisions differ from HF's"
    assert d["missing_grads"] == []
    bad = grad_mismatches(d["grads"], GRAD_RTOL)
    assert not bad, bad
