"""The toolkit's core attention for the megatron path (toolkit/adapters/megatron/attention.py).

Against references we did not write in the module: a plain masked-softmax attention written here
(K/V repeated per head, the mask spelled out token by token, float64), HF's own RoPE
(``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``), and HF's own forward of packed rows (HF
confines attention to each document when position_ids restart, with no attention mask) through the
megatron engine at TP2+SP and PP2. Every kernel the CPU can run: sdpa (plain causal and per document span, a
window through a band mask), the math path (softcapping), flex_attention forward (no CPU backward in torch).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.helpers.attention import CASES, DOCS, B, D, G, H, S, qkv, reference_attention, reference_mask
from toolkit.adapters.megatron.attention import (
    AttentionOptions,
    TokenLayout,
    attend,
    choose_kernel,
    core_attention_class,
    describe_kernels,
    positions_in_documents,
    rotate_half,
)
from toolkit.config import ConfigError

POSITIONS = torch.tensor([list(range(7)) + list(range(10)) + list(range(7)), list(range(24))])


# --- the computation against the plain reference ------------------------------------------------------

@pytest.mark.parametrize("mode,case", [(m, c) for m in ("auto", "sdpa") for c in sorted(CASES)
                                       if not (m == "sdpa" and CASES[c][2])])  # sdpa cannot softcap (refused)
def test_forward_and_gradients_match_the_reference(mode, case):
    """CPU: sdpa (causal, per document span, a band mask for windows) and, for softcapping, the math path;
    fp32 vs float64."""
    docs, window, softcap = CASES[case]
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long), document_ids=docs)
    q, k, v = qkv()
    out = attend(q, k, v, layout, mode, window=window, scale=D ** -0.5, softcap=softcap)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = reference_attention(q2, k2, v2, reference_mask(docs, window), D ** -0.5, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    for mine, theirs in ((q, q2), (k, k2), (v, v2)):  # K/V grads: summed over the heads sharing them
        torch.testing.assert_close(mine.grad.double(), theirs.grad.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_forward_matches_the_reference(case):
    """flex_attention on CPU: forward only (torch 2.13 has no CPU backward; on a GPU it also trains)."""
    docs, window, softcap = CASES[case]
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long), document_ids=docs)
    q, k, v = qkv(requires_grad=False)
    with torch.no_grad():
        out = attend(q, k, v, layout, "flex", window=window, scale=D ** -0.5, softcap=softcap)
    ref = reference_attention(q, k, v, reference_mask(docs, window), D ** -0.5, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def test_documents_in_a_packed_row_equal_each_document_alone():
    """Row 0 packs three documents; each one's output equals attending over it alone."""
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long), document_ids=DOCS)
    q, k, v = qkv(requires_grad=False)
    packed = attend(q, k, v, layout, scale=D ** -0.5)
    for lo, hi in ((0, 7), (7, 17), (17, 24)):
        alone = TokenLayout.of(torch.zeros(1, hi - lo, dtype=torch.long))
        one = attend(q[:1, :, lo:hi], k[:1, :, lo:hi], v[:1, :, lo:hi], alone, scale=D ** -0.5)
        torch.testing.assert_close(packed[:1, :, lo:hi], one, atol=1e-6, rtol=1e-6)


def test_dropout_draws_only_in_training_and_flex_refuses_it():
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long))
    q, k, v = qkv(requires_grad=False)
    plain = attend(q, k, v, layout, scale=D ** -0.5)
    assert not torch.allclose(attend(q, k, v, layout, scale=D ** -0.5, dropout=0.5), plain)
    with pytest.raises(ConfigError, match="megatron.attention=flex has no attention dropout"):
        attend(q, k, v, layout, "flex", scale=D ** -0.5, dropout=0.5)


# --- positions, RoPE, the layout --------------------------------------------------------------------

def test_positions_restart_per_document_and_boundaries_come_only_from_documents():
    ids = torch.zeros(B, S, dtype=torch.long)
    assert torch.equal(positions_in_documents(DOCS), POSITIONS)
    assert torch.equal(TokenLayout.of(ids, document_ids=DOCS).position_ids, POSITIONS)
    cu = torch.tensor([0, 7, 17, 24, 48])  # flash-attn's varlen convention over the flattened batch
    from_cu = TokenLayout.from_cu_seqlens(ids, cu)
    assert torch.equal(from_cu.position_ids, POSITIONS)
    assert torch.equal(from_cu.allowed(None), reference_mask(DOCS, None))
    # restarting positions alone do not split documents (guessing boundaries from them is a known trap)
    assert torch.equal(TokenLayout.of(ids, position_ids=POSITIONS).allowed(None), reference_mask(None, None))
    # a label that comes back after another document starts a new document
    again, distinct = torch.tensor([[0] * 8 + [1] * 8 + [0] * 8]), torch.tensor([[0] * 8 + [1] * 8 + [2] * 8])
    assert torch.equal(TokenLayout.of(ids[:1], document_ids=again).allowed(None), reference_mask(distinct, None))


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_rope_at_per_token_positions_is_hfs(rope_scaling):
    """HF's own rotary embedding and apply_rotary_pos_emb at positions that restart per document."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from toolkit.adapters.megatron.weights import rope_inv_freq
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=G, rope_theta=5000.0,
                         max_position_embeddings=64, rope_scaling=rope_scaling)
    q, k, _ = qkv(requires_grad=False)
    cos, sin = LlamaRotaryEmbedding(config)(q, POSITIONS)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long), document_ids=DOCS)
    my_cos, my_sin = layout.rotary(rope_inv_freq(config, D), q.dtype)
    mine = [rotate_half(x.permute(2, 0, 1, 3), my_cos, my_sin).permute(1, 2, 0, 3) for x in (q, k)]
    assert torch.equal(mine[0], hf_q) and torch.equal(mine[1], hf_k)


def test_token_layout_is_megatrons_packed_seq_params_and_checks_its_inputs():
    from megatron.core.packed_seq_params import PackedSeqParams
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long))
    assert all(hasattr(layout, f.name) for f in dataclasses.fields(PackedSeqParams))
    assert layout.qkv_format == "sbhd"  # megatron's packed ('thd') paths stay off
    with pytest.raises(ValueError, match="document_ids .* and position_ids .* differ in shape"):
        TokenLayout(POSITIONS, DOCS[:, :8])
    with pytest.raises(ValueError, match="position_ids must be an integer tensor"):
        TokenLayout(POSITIONS.float())


def test_strict_mode_refuses_host_positions():
    from tests.helpers.device import as_toolkit_code
    from toolkit import device
    device.enable_strict()
    try:
        with pytest.raises(device.DeviceError, match="position_ids is a host tensor"):
            as_toolkit_code("from toolkit.adapters.megatron.attention import TokenLayout\n"
                            "TokenLayout(torch.arange(8).expand(2, 8))")
    finally:
        device.disable_strict()


# --- kernel choice ------------------------------------------------------------------------------------

def test_kernel_choice_per_device_and_need():
    def pick(mode, dev, **kw):
        return choose_kernel(mode, dev, **{"masked": False, "softcap": False, "dropout": False, **kw})
    assert [pick("auto", d) for d in ("cpu", "cuda")] == ["sdpa", "sdpa"]
    assert [pick("auto", d, masked=True) for d in ("cpu", "cuda")] == ["sdpa", "flex"]
    assert [pick("auto", d, softcap=True) for d in ("cpu", "cuda")] == ["math", "flex"]
    assert pick("auto", "cuda", masked=True, dropout=True) == "sdpa"  # flex has no dropout
    assert pick("auto", "cuda", softcap=True, dropout=True) == "math"
    assert pick("flex", "cpu", grad=False) == "flex" and pick("sdpa", "cuda", masked=True) == "sdpa"
    line = describe_kernels("auto", "cpu", "fp32", rope=True)
    assert "causal rows -> sdpa" in line and "documents/windows -> sdpa per document span" in line


@pytest.mark.parametrize("mode,need,message", [
    ("sdpa", {"softcap": True}, "megatron.attention=sdpa cannot cap attention logits"),
    ("flex", {"dropout": True}, "megatron.attention=flex has no attention dropout"),
    ("flex", {}, "megatron.attention=flex cannot train on CPU"),
])
def test_kernel_choice_refuses_what_a_kernel_cannot_do(mode, need, message):
    with pytest.raises(ConfigError, match=message):
        choose_kernel(mode, "cpu", **{"masked": False, "softcap": False, "dropout": False, **need})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_flex_is_refused_before_launch_without_a_gpu():
    from toolkit.adapters.megatron import check_machine
    from toolkit.config import validate
    from toolkit.families.tiny import tiny_config
    from toolkit.plan import build_plan
    plan = build_plan(validate({"backend": "megatron", "megatron": {"attention": "flex"}}), [1],
                      hf_config=tiny_config("llama"))
    with pytest.raises(ConfigError, match="megatron.attention=flex needs a GPU to train"):
        check_machine(plan)


# --- the megatron submodule ---------------------------------------------------------------------------

def megatron_module(options: AttentionOptions, dropout: float = 0.0, layer_number: int = 1):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    config = TransformerConfig(num_layers=2, hidden_size=H * D, num_attention_heads=H, num_query_groups=G,
                               kv_channels=D, attention_dropout=dropout, use_cpu_initialization=True)
    return core_attention_class()(config, layer_number, AttnMaskType.causal, "self", options=options)


def test_megatron_submodule_rotates_at_per_token_positions_and_masks_documents():
    """megatron's layout in and out ([s, b, heads, d] -> [s, b, heads * d]); HF's RoPE at the
    restarting positions, then the plain reference per document; no parameters."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from toolkit.adapters.megatron.weights import rope_inv_freq
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=G, rope_theta=5000.0)
    module = megatron_module(AttentionOptions(inv_freq=rope_inv_freq(config, D), windows=(None, 5)), layer_number=2)
    assert list(module.parameters()) == [] and module.state_dict() == {}
    q, k, v = qkv(requires_grad=False)
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long), document_ids=DOCS)
    out = module(*(x.permute(2, 0, 1, 3) for x in (q, k, v)), None, packed_seq_params=layout)
    cos, sin = LlamaRotaryEmbedding(config)(q, POSITIONS)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    ref = reference_attention(hf_q, hf_k, v, reference_mask(DOCS, 5), 1 / math.sqrt(D))  # layer 2's window
    assert out.shape == (S, B, H * D)
    torch.testing.assert_close(out.double(), ref.permute(2, 0, 1, 3).reshape(S, B, H * D), atol=2e-6, rtol=2e-6)
    with pytest.raises(TypeError, match="needs a TokenLayout as GPTModel's packed_seq_params"):
        module(*(x.permute(2, 0, 1, 3) for x in (q, k, v)), None)


def test_local_attention_refuses_packed_documents():
    from types import SimpleNamespace

    from toolkit.adapters.megatron import MegatronEngine
    mb = {"input_ids": torch.zeros(B, S, dtype=torch.long), "document_ids": DOCS}
    with pytest.raises(ConfigError, match="megatron.attention=local applies neither per-token positions nor "
                                          "document masks"):
        MegatronEngine._model_inputs(SimpleNamespace(attention=None, router_stats=None, cp_group=None), mb)


def test_megatron_submodule_drops_out_in_training_only():
    module = megatron_module(AttentionOptions(), dropout=0.5)
    module.dropout_rng = None  # no model-parallel RNG tracker in this process: the default generator
    q, k, v = (x.permute(2, 0, 1, 3) for x in qkv(requires_grad=False))
    layout = TokenLayout.of(torch.zeros(B, S, dtype=torch.long))
    module.eval()
    ref = reference_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), reference_mask(None, None), D ** -0.5)
    torch.testing.assert_close(module(q, k, v, None, packed_seq_params=layout).double(),
                               ref.permute(2, 0, 1, 3).reshape(S, B, H * D), atol=2e-6, rtol=2e-6)
    module.train()
    assert not torch.allclose(module(q, k, v, None, packed_seq_params=layout).double(),
                              ref.permute(2, 0, 1, 3).reshape(S, B, H * D), atol=1e-3)


# --- packed rows through the megatron engine vs HF's own forward (2 gloo ranks) --------------------------

PACKED_LAYOUTS = {"tp2": (2, 1, {}), "tp2_sp": (2, 1, {"sequence_parallel": True}), "pp2": (1, 2, {}),
                  "pp2_vpp2": (1, 2, {"vpp": 2}), "ep2": (1, 1, {"ep": 2})}
PACKED_FAMILIES = ("llama", "gpt2", "qwen2", "qwen2_moe")  # RoPE with llama3 scaling; learned positions; biases; MoE
PACKED_CASES = [(f, lay) for f in PACKED_FAMILIES for lay in PACKED_LAYOUTS
                if not (f == "qwen2_moe" and lay in ("tp2", "pp2_vpp2"))  # MoE at TP only with SP; 2 layers
                and not (f == "qwen2" and lay == "pp2_vpp2") and (f == "qwen2_moe" or lay != "ep2")]
PACKED_DOCS = [[1] * 5 + [2] * 8 + [0] * 3, [7] * 16, [3] * 11 + [4] * 5, [1] * 2 + [2] * 11 + [0] * 3]
"""Document ids as ``toolkit/data`` writes them: 0 is the padded tail (no loss; MoE routers skip it)."""


def packed_micro_batches(vocab: int) -> list[dict]:
    """Two micro-batches of two 16-token rows, most of them several documents; ``document_ids``
    only (the engine derives the positions), and the positions HF is given, written out here."""
    from tests.helpers.parity import batches
    rows = batches(vocab, n_micro=4, mbs=1, seq=16)
    docs = torch.tensor(PACKED_DOCS)
    return [{"input_ids": torch.cat([rows[i]["input_ids"], rows[i + 1]["input_ids"]]),
             "labels": torch.cat([rows[i]["labels"], rows[i + 1]["labels"]]).masked_fill(docs[i:i + 2] == 0, -100),
             "document_ids": docs[i:i + 2],
             "hf_positions": torch.tensor([restarting_positions(r) for r in PACKED_DOCS[i:i + 2]])} for i in (0, 2)]


def restarting_positions(row: list[int]) -> list[int]:
    positions = []
    for i, doc in enumerate(row):
        positions.append(0 if i == 0 or doc != row[i - 1] else positions[-1] + 1)
    return positions


def _packed_rank(rank, world):
    from tests.helpers.ranks import release_megatron
    results = {}
    for family, name in PACKED_CASES:
        tp, pp, extra = PACKED_LAYOUTS[name]
        results[(name, family)] = _packed_case(family, tp, pp, extra)
        release_megatron()
    return results


def _packed_case(family, tp, pp, extra) -> dict:
    """HF's own forward of the packed rows (positions restarting per document) against the engine's:
    logits, gradients of the mean token loss, and for MoE the tokens per expert of real tokens."""
    from tests.helpers.ranks import megatron_engine
    from toolkit.adapters import moe
    from toolkit.config import validate
    from toolkit.families import get_family, unpack
    from toolkit.families.tiny import tiny_model
    from toolkit.loss import IGNORE_INDEX, token_loss_sum
    model = tiny_model(family)
    micro = packed_micro_batches(model.config.vocab_size)
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
    ref_logits, ref_counts = [], 0
    is_moe = moe.is_router_model(model.config)
    for mb in micro:  # HF confines attention to a document when position_ids restart
        out = model(input_ids=mb["input_ids"], position_ids=mb["hf_positions"], use_cache=False,
                    output_router_logits=is_moe)
        (token_loss_sum(out.logits, mb["labels"])[0] / tokens).backward()
        ref_logits.append(out.logits.detach())
        if is_moe:
            real = (mb["document_ids"] > 0).reshape(-1)
            ref_counts = ref_counts + torch.stack([moe.routed_counts(z.detach()[real], model.config.num_experts_per_tok)
                                                   for z in out.router_logits]).double()
    cfg = validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, **extra},
                    "train": {"global_batch_size": 4, "micro_batch_size": 2, "moe_aux_loss_coeff": 0.0}})
    engine = megatron_engine(cfg, model)
    dp = engine.dp_size  # ep2 on 2 ranks: DP 2, one micro-batch each
    mine = [{k: v for k, v in mb.items() if k != "hf_positions"} for mb in micro][engine.dp_rank::dp]
    got = engine.logits(mine)
    engine.forward_backward(mine, tokens, complete_grads=True)
    grads = engine.hf_state(attr="main_grad")
    result = {}
    if got is not None:
        result["logits"] = max((a - b).abs().max().item() for a, b in zip(got, ref_logits[engine.dp_rank::dp]))
    if grads is not None:
        ref = unpack(get_family(family), model.config, {n: p.grad for n, p in model.named_parameters()})
        ref.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
        result["grads"] = {n: ((grads[n] - g).abs().max().item(), g.abs().max().item()) for n, g in ref.items()}
    if is_moe:
        result["counts"] = [engine.router_stats.counts.clone()]  # this rank's share, summed below
        result["ref_counts"] = ref_counts
    return result


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU/gloo parity")
    from tests.helpers.ranks import run_ranks
    merged = {}
    for r in run_ranks(_packed_rank, 2, tmp_path_factory.mktemp("packed"), timeout=600):
        for key, d in r.items():
            counts = merged.get(key, {}).get("counts", []) + d.pop("counts", [])
            logits = max(merged.get(key, {}).get("logits", 0.0), d.pop("logits", 0.0))  # DP ranks: each its own
            merged.setdefault(key, {}).update(d, logits=logits)
            if counts:
                merged[key]["counts"] = counts
    print("\nmax |diff| HF vs megatron, packed rows:")
    for (name, family), d in merged.items():
        print(f"  {name} {family}: logits {d['logits']:.2e} grads {max(x[0] for x in d['grads'].values()):.2e}")
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", PACKED_CASES)
def test_packed_rows_match_hf_logits_and_gradients(packed, family, layout):
    """Document masks and restarting positions reach every TP rank and pipeline stage: each packed
    document's logits, and every parameter's gradient, equal HF's own forward of the packed rows;
    MoE routers count the real tokens only (the padded tails left out), as HF routes them."""
    from tests.helpers.parity import GRAD_RTOL, LOGIT_TOL, grad_mismatches, worst_ratio
    d = packed[(layout, family)]
    ratio, worst = worst_ratio(d["grads"])
    print(f"\n{family} {layout} packed: logits {d['logits']:.2e}, worst grad {ratio:.2e} of its max ({worst})")
    assert d["logits"] < LOGIT_TOL  # the unpacked parity's bounds, per parameter relative to its own gradient
    bad = grad_mismatches(d["grads"], GRAD_RTOL)
    assert not bad, bad
    if "ref_counts" in d:
        assert torch.equal(sum(d["counts"]), d["ref_counts"])


# --- flex_attention's block mask, from document boundaries -----------------------------------------------

def random_documents(b: int, s: int, seed: int) -> torch.Tensor:
    """[b, s] document labels: runs of 1 to 400 tokens, some labels skipped."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        row, label = [], 0
        while len(row) < s:
            row += [label] * [1, 3, 50, 127, 129, 400][int(torch.randint(6, (1,), generator=g))]
            label += int(torch.randint(1, 3, (1,), generator=g))
        rows.append(row[:s])
    return torch.tensor(rows)


@pytest.mark.parametrize("s", [77, 128, 300, 512])
@pytest.mark.parametrize("window", [None, 5, 130])
@pytest.mark.parametrize("documents", [False, True])
def test_block_mask_is_create_block_masks(s, window, documents):
    """The tiles computed from document boundaries are those torch's ``create_block_mask``
    finds by evaluating the mask at every (query, key): partial and full, counts and order, both
    directions (a sequence not a multiple of the 128 tile included)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from toolkit.adapters.attention import visibility
    docs = random_documents(3, s, seed=s) if documents else None
    layout = TokenLayout.of(torch.zeros(3, s, dtype=torch.long), document_ids=docs)
    mine = layout.block_mask(window)
    ref = create_block_mask(visibility(layout.document_ids, window), 3 if documents else None, None, s, s, device="cpu")
    assert torch.equal(mine.to_dense(), ref.to_dense())
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        n = getattr(ref, counts)
        assert torch.equal(getattr(mine, counts), n), counts
        used = torch.arange(getattr(ref, indices).shape[-1]) < n[..., None]  # entries past the count are unused
        assert torch.equal(getattr(mine, indices)[used], getattr(ref, indices)[used]), indices
    assert mine.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(s - 1), torch.tensor(s - 2)) == \
        bool(layout.allowed(window)[0, 0, s - 1, s - 2])


def test_block_mask_materializes_no_s_by_s_tensor():
    """Per micro-batch the block mask costs O(b * s) memory, not the [b, 1, s, s] mask torch's
    ``create_block_mask`` evaluates (measured: its largest allocation 16 MiB at b=2, s=1024, an
    int64 [b, 1, s, s]; from the boundaries 16 KiB, the [b, s] int64 starts)."""
    from torch.profiler import ProfilerActivity, profile
    b, s = 2, 1024
    layout = TokenLayout.of(torch.zeros(b, s, dtype=torch.long), document_ids=random_documents(b, s, seed=1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        layout.block_mask(None)
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert max(sizes) <= 8 * b * s, f"largest allocation {max(sizes)} bytes; b * s * s = {b * s * s}"


# --- without a working torch.compile -------------------------------------------------------------------

@pytest.fixture
def fresh_probe():
    """The compile probe forgets its answers before and after (it is cached per process)."""
    from toolkit.adapters import compiled
    compiled.compile_failure.cache_clear()
    yield compiled
    compiled.compile_failure.cache_clear()


def test_compile_probe_fails_without_a_c_compiler(fresh_probe, monkeypatch, capsys):
    """The probe compiles a tiny function for real: with inductor's C++ compiler missing (as
    Triton's C compiler can be on a GPU machine) it reports why, and prints it once."""
    import torch._dynamo
    import torch._inductor.config
    assert fresh_probe.compile_works("cpu")
    fresh_probe.compile_failure.cache_clear()
    torch._dynamo.reset()
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("/nonexistent/bin/cc",))
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    reason = fresh_probe.compile_failure("cpu")
    assert reason is not None and not fresh_probe.compile_works("cpu")
    out = capsys.readouterr().out
    assert out.count("torch.compile does not work on cpu here") == 1 and "falls back to sdpa" in out
    torch._dynamo.reset()


def test_compile_probe_can_be_switched_off(fresh_probe, monkeypatch):
    monkeypatch.setenv("TOOLKIT_COMPILE", "0")
    assert fresh_probe.compile_failure("cpu") == "TOOLKIT_COMPILE=0"


def test_without_compile_the_gpu_takes_the_cpus_kernels(monkeypatch):
    """Where torch.compile fails on the GPU, ``auto`` falls back to sdpa with a boolean mask (math
    with a softcap), flex asked for by name is refused naming the cause, and the logged lines say
    so; with compile working, flex as before."""
    from toolkit.adapters import attention, compiled, hf_attention
    pick = choose_kernel
    assert pick("auto", "cuda", masked=True, softcap=False, dropout=False, no_compile="no cc") == "sdpa"
    assert pick("auto", "cuda", masked=False, softcap=True, dropout=False, no_compile="no cc") == "math"
    assert pick("auto", "cuda", masked=True, softcap=True, dropout=False, no_compile=None) == "flex"
    with pytest.raises(ConfigError, match=r"megatron.attention=flex needs torch.compile, which fails here \(no cc\)"):
        pick("flex", "cuda", masked=True, softcap=False, dropout=False, no_compile="no cc")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compiled, "compile_failure", lambda device_type: "no cc")
    assert attention.flex_unavailable("cuda") == "no cc" and attention.flex_unavailable("cpu") is None
    assert "documents -> sdpa" in hf_attention.describe("cuda", dropout=False)
    assert "documents -> math" in hf_attention.describe("cuda", dropout=False, softcap=True)
    assert "documents/windows -> sdpa with a boolean mask" in describe_kernels("auto", "cuda", "bf16", rope=True)


@pytest.mark.parametrize("compiles", [True, False])
def test_megatron_fusions_need_a_working_compile(monkeypatch, compiles):
    """megatron's fused bias-dropout-add and SwiGLU (torch.compile'd, on by default on GPUs) are
    off where the compile probe fails, on where it works (a GPU is pretended: the fusions are GPU only)."""
    from toolkit.adapters.megatron import model as megatron_model
    from toolkit.config import validate
    from toolkit.families import get_family
    from toolkit.families.tiny import tiny_config
    from toolkit.plan import build_plan
    cfg = validate({"backend": "megatron", "train": {"global_batch_size": 2, "micro_batch_size": 1}})
    hf_config = tiny_config("llama")
    layout = build_plan(cfg, [1], hf_config=hf_config).layout(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_model, "compile_works", lambda device_type: compiles)
    tc = megatron_model.transformer_config(cfg, layout, hf_config, get_family("llama"))
    assert (tc.bias_dropout_fusion, tc.bias_activation_fusion) == (compiles, compiles)
