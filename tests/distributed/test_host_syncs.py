"""Host syncs on the step path: ``toolkit.syncs.SyncCounter`` counts the calls that make the host wait
for the device (``.item()``, boolean indexing, ``bincount``, ``.cpu()`` of a device tensor, ...); a
training step's count must not grow with the number of layers or micro-batches.

Counted on the CPU, where nothing waits: the counter knows the calls that would wait on a GPU
(strict mode's host marks tell host tensors from device ones)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import batches
from tests.helpers.ranks import run_ranks
from toolkit import device
from toolkit.adapters import moe
from toolkit.config import validate
from toolkit.families.tiny import tiny_model
from toolkit.loss import IGNORE_INDEX
from toolkit.syncs import count_syncs

LAYOUTS = [(2, 1), (2, 4), (4, 1), (4, 4)]  # (layers, micro-batches)
DENSE_SYNCS = 4
"""Measured per fp32 step of megatron (llama, any layers and micro-batches): megatron's grad norm
(its l2-norm fallback without Apex reads 2 values, ``clip_grads`` 1) and the toolkit's loss read."""
MEGATRON_MOE_DISPATCH = "megatron/core/transformer/moe/"
"""megatron's allgather token dispatcher sizes each expert's tokens on the host (``.cpu()``,
``masked_select``): 3 syncs per MoE layer and micro-batch, megatron's own, not counted against the
bound below."""
MOE_SYNCS = 5  # DENSE_SYNCS + the router statistics' one copy to the host per step


# --- the counter (no processes) ----------------------------------------------------------------------

def test_counter_counts_reads_data_sized_outputs_and_copies_to_the_host():
    x = torch.randn(8)
    with count_syncs() as syncs:
        x.sum().item(), x.tolist(), bool(x[0] > 0), float(x[1]), f"{x.sum():.2f}"  # 5 reads
        x[x > 0], x.nonzero(), torch.bincount(torch.arange(3)), torch.repeat_interleave(torch.arange(3))  # 4
        host = x.cpu()  # 1: a device tensor copied to the host
        torch.tensor(1.0, device=device.rank_device())  # 1: a blocking copy of a Python number
        host.to(device.rank_device()).sum().item()  # 1: back on the device, read again
        x.sum().item()  # 1: x stays a device tensor (the CPU's .cpu() returned x itself)
    assert syncs.total == 13, syncs.sites


def test_counter_skips_what_waits_for_nothing():
    x = torch.randn(8)
    with count_syncs() as syncs:
        host = x.cpu()
        host.sum().item(), host.tolist(), host[host > 0], host.double().sum().item()  # already on the host
        y = x.clone()
        y[x > 0] = 0.0  # masked_fill_: no output sized by the data
        y.view(4, 2)[(x > 0)[:4], :] = 0.0  # megatron's embedding mask (TP): masked_fill_ too
        torch.topk(x, 2), x[torch.tensor([0, 2])], x[1:3], torch.tensor(1.0)  # a host tensor
        p = torch.nn.Parameter(torch.randn(3))
        p.grad = torch.ones(3)
        torch.optim.AdamW([p]).step()  # torch keeps the optimizer's step counts on the host
    assert syncs.total == 1, syncs.sites  # the .cpu()


# --- the router loss of the DeepSpeed path (no processes) --------------------------------------------

def _router_inputs(layers: int):
    model = tiny_model("mixtral", num_hidden_layers=layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 16, dtype=torch.bool)
    real[0, 11:] = False  # a padded tail (rows packed by documents)
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    return model, logits, real.reshape(-1)


def _indexed_reference(router_logits, real, top_k: int):
    """The loss as the boolean-indexing code computed it: the real rows selected, counted with bincount."""
    total, counts = 0.0, []
    for z in router_logits:
        z = z[real]
        c = torch.bincount(torch.topk(z, top_k, dim=-1).indices.reshape(-1), minlength=z.shape[-1])
        total, counts = total + moe.load_balancing_loss(z, c, z.shape[0]), counts + [c]
    return total / len(router_logits), torch.stack(counts)


@pytest.mark.parametrize("layers", [2, 4])
def test_deepspeed_router_loss_syncs_nothing_and_equals_indexing(layers):
    from toolkit.adapters.deepspeed.moe import RouterLoss
    model, router_logits, real = _router_inputs(layers)
    router = RouterLoss(validate({"train": {"moe_aux_loss_coeff": 1.0}}), model)
    with count_syncs() as syncs:
        loss = router.loss(router_logits, real)
    assert syncs.total == 0, syncs.sites
    ref_loss, ref_counts = _indexed_reference(router_logits, real, model.config.num_experts_per_tok)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert torch.equal(router.stats.counts, ref_counts.double())


# --- megatron training steps (one gloo rank) ---------------------------------------------------------

def packed(micro_batches):
    """Rows packed by documents (two documents and a padded tail): the routers' padding path."""
    for mb in micro_batches:
        mb["document_ids"] = torch.tensor([[1] * 6 + [2] * 7 + [0] * 3])
        mb["position_ids"] = torch.tensor([list(range(6)) + list(range(7)) + list(range(3))])
        mb["labels"][mb["document_ids"] == 0] = IGNORE_INDEX
    return micro_batches


def _step_syncs(rank, world, family, layouts=LAYOUTS, megatron=None, hf_changes=None):
    """{(layers, micro-batches): the second training step's syncs by site}."""
    from tests.helpers.ranks import megatron_engine, release_megatron
    out = {}
    for layers, n_micro in layouts:
        model = tiny_model(family, num_hidden_layers=layers, **(hf_changes or {}))
        micro = packed(batches(model.config.vocab_size, n_micro=n_micro))
        cfg = validate({"backend": "megatron", "megatron": megatron or {},
                        "train": {"global_batch_size": n_micro, "micro_batch_size": 1, "moe_aux_loss_coeff": 0.01}})
        engine = megatron_engine(cfg, model)
        tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
        engine.train_step(micro, tokens, 1e-3)  # the first step allocates megatron's optimizer state
        with count_syncs() as syncs:
            engine.train_step(micro, tokens, 1e-3)
        out[(layers, n_micro)] = syncs.sites
        release_megatron()
    return out


def _without(sites: dict, prefix: str) -> int:
    return sum(n for site, n in sites.items() if not site.startswith(prefix))


def test_megatron_dense_step_syncs_do_not_grow_with_layers_or_micro_batches(tmp_path):
    counts = run_ranks(_step_syncs, 1, tmp_path, "llama")[0]
    print("\nmegatron llama syncs per step by (layers, micro-batches):", counts)
    totals = {k: sum(sites.values()) for k, sites in counts.items()}
    assert set(totals.values()) == {DENSE_SYNCS}, totals


def test_megatron_tp2_sequence_parallel_dropout_step_syncs_do_not_grow(tmp_path):
    """TP: megatron's embedding masks its vocabulary range (a masked fill, no sync) and its RNG
    tracker forks per dropout region (comparing host generator states, no sync either)."""
    counts = run_ranks(_step_syncs, 2, tmp_path, "llama", [(2, 1), (4, 4)], {"tp": 2, "sequence_parallel": True},
                       {"attention_dropout": 0.1})[0]
    print("\nmegatron llama TP2 SP dropout syncs per step by (layers, micro-batches):", counts)
    totals = {k: sum(sites.values()) for k, sites in counts.items()}
    assert set(totals.values()) == {DENSE_SYNCS}, totals


def test_megatron_moe_step_syncs_do_not_grow_with_layers_or_micro_batches(tmp_path):
    counts = run_ranks(_step_syncs, 1, tmp_path, "mixtral")[0]
    print("\nmegatron mixtral syncs per step by (layers, micro-batches):", counts)
    totals = {k: _without(sites, MEGATRON_MOE_DISPATCH) for k, sites in counts.items()}
    assert set(totals.values()) == {MOE_SYNCS}, totals
