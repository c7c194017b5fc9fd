"""The CPU compatibility layer: applied and removed cleanly; megatron-core TP=2 forward/backward on gloo.

``run_ranks``, the spawner the gloo tests use for in-process ranks, lives in tests/helpers/ranks.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks
from toolkit.compat import megatron_core, megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inert with a GPU")


# --- applied and removed cleanly --------------------------------------------------------------------

def _originals():
    from megatron.core.tensor_parallel import random as r
    return (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state, torch.cuda.set_rng_state,
            torch.cuda.manual_seed, torch.Tensor.cuda, torch.Tensor.type, r._get_cuda_rng_state,
            r._set_cuda_rng_state, "cuda" in torch.Tensor.__dict__, "type" in torch.Tensor.__dict__,
            *(fn.__dict__["backward"] for fn in megatron_cpu._megatron_autograd_functions()))


def test_enable_disable_restore_everything_and_nest():
    before = _originals()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    with megatron_cpu.cpu_compat():
        assert megatron_cpu.is_enabled()
        with megatron_cpu.cpu_compat():  # nested: idempotent
            assert torch.empty(2, device="cuda").device.type == "cpu"
        assert megatron_cpu.is_enabled()
        x = torch.zeros(3, device=torch.cuda.current_device())
        assert x.device.type == "cpu" and x.cuda() is x and x.to("cuda").device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64
        torch.cuda.synchronize()
    assert not megatron_cpu.is_enabled()
    assert _originals() == before
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    megatron_cpu.disable()  # extra disable: harmless
    assert _originals() == before


def test_cuda_rng_stand_ins_drive_the_cpu_generator():
    from megatron.core.tensor_parallel import random as r
    with megatron_cpu.cpu_compat():
        torch.cuda.manual_seed(7)
        state = r._get_cuda_rng_state()
        a = torch.rand(4)
        r._set_cuda_rng_state(state)
        assert torch.equal(torch.rand(4), a)
        assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())


# --- megatron-core on gloo ---------------------------------------------------------------------------

def _tp2_forward_backward(rank, world):
    with megatron_cpu.cpu_compat():
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        model_parallel_cuda_manual_seed(1)
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
                                add_bias_linear=False, activation_func=torch.nn.functional.silu,
                                hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2,
                                **megatron_cpu.TRANSFORMER_CONFIG)
        model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128,
                         max_sequence_length=32, position_embedding_type="rope")
        torch.manual_seed(0)
        ids = torch.randint(0, 128, (2, 16))
        labels = torch.randint(0, 128, (2, 16))
        loss = model(ids, torch.arange(16).expand(2, 16), None, labels=labels)  # [b, s] per-token loss
        loss.mean().backward()
        grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        ps.destroy_model_parallel()
        return {"loss": loss.mean().item(), "grads": grads,
                "qkv_shape": tuple(model.decoder.layers[0].self_attention.linear_qkv.weight.shape)}


def test_gpt_model_tp2_forward_backward_on_gloo(tmp_path):
    r0, r1 = run_ranks(_tp2_forward_backward, 2, tmp_path)
    assert r0["loss"] == pytest.approx(r1["loss"], rel=1e-6)  # vocab-parallel CE reduces over TP
    assert r0["qkv_shape"] == (1 * (2 + 2) * 16, 64)  # 1 of 2 KV groups per rank: (2 q + k + v) x 16 rows
    assert all(torch.isfinite(torch.tensor(v)) and v > 0 for v in r0["grads"].values())
    assert r0["grads"]["decoder.final_layernorm.weight"] == pytest.approx(
        r1["grads"]["decoder.final_layernorm.weight"], rel=1e-5)  # replicated params see the same grads


def _moe_ep2_forward_backward(rank, world):
    """4 experts, top-2, expert parallel 2 (2 experts per rank), megatron's allgather dispatcher.
    Each rank has its own tokens. Three passes: both ranks' first batches; rank 0 with another
    batch; rank 1 with another batch. A rank's experts see the other rank's tokens exactly when
    changing only the other rank's batch changes their gradients."""
    megatron_core.bind_missing_te_names()  # no Transformer Engine here
    with megatron_cpu.cpu_compat():
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig
        ps.initialize_model_parallel(expert_model_parallel_size=2)
        model_parallel_cuda_manual_seed(1)
        cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                                activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
                                num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.01,
                                expert_model_parallel_size=2, **megatron_cpu.TRANSFORMER_CONFIG)
        spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm")
        model = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=32, position_embedding_type="rope")
        passes = []
        for seeds in ((0, 1), (2, 1), (0, 3)):  # (rank 0's batch, rank 1's batch) per pass
            g = torch.Generator().manual_seed(seeds[rank])
            ids, labels = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
            model.zero_grad()
            loss = model(ids, torch.arange(16).expand(2, 16), None, labels=labels)
            loss.mean().backward()
            passes.append({"loss": loss.mean().item(), "expert_grads": {
                n: p.grad.clone() for n, p in model.named_parameters() if ".experts." in n and p.grad is not None}})
        experts = list(model.decoder.layers[0].mlp.local_expert_indices)
        ps.destroy_model_parallel()
        return {"passes": passes, "experts": experts,
                "expert_params": sorted(n for n, _ in model.named_parameters() if ".experts." in n)}


def _changed(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


def test_moe_expert_parallel_forward_backward_on_gloo(tmp_path):
    r0, r1 = run_ranks(_moe_ep2_forward_backward, 2, tmp_path)
    assert (r0["experts"], r1["experts"]) == ([0, 1], [2, 3])  # each rank holds its own experts
    first0, first1 = r0["passes"][0], r1["passes"][0]
    assert first0["loss"] != first1["loss"]  # the ranks hold different tokens
    for r in (r0, r1):  # every local expert received tokens and a gradient
        assert sorted(r["passes"][0]["expert_grads"]) == r["expert_params"]
        assert all(g.abs().max() > 0 for g in r["passes"][0]["expert_grads"].values())
    # rank 0's new batch (pass 2) reaches rank 1's experts; rank 1's new batch (pass 3) rank 0's
    assert _changed(first1["expert_grads"], r1["passes"][1]["expert_grads"]), "rank 0's tokens never reach rank 1"
    assert _changed(first0["expert_grads"], r0["passes"][2]["expert_grads"]), "rank 1's tokens never reach rank 0"
    # rank 1's tokens did not change, so neither may its loss: outputs come back to the rank they came from
    assert r1["passes"][1]["loss"] == first1["loss"], "rank 1's loss moved with rank 0's tokens"
    assert r0["passes"][2]["loss"] == first0["loss"], "rank 0's loss moved with rank 1's tokens"
