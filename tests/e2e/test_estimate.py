"""toolkit estimate and toolkit train --dry-run: formulas, CLI, errors, and the model-state figures
against what real engines hold (tests/scripts/measure_memory.py)."""
from __future__ import annotations

import json
import math

import pytest
from transformers import LlamaConfig

from tests.helpers.loss import loss_allocations
from tests.helpers.runs import REPO, run_cli, run_in_process
from toolkit.cli import main
from toolkit.config import load_config
from toolkit.estimate.memory import GiB, memory, suggestions
from toolkit.estimate.steptime import Cluster, collective_seconds, step_time
from toolkit.plan.checks import check_layout
from toolkit.plan.model import model_spec

LLAMA_7B = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000)
BIG_RUN = ["data.seq_len=4096", "train.global_batch_size=512", "train.micro_batch_size=1", "model.dtype=bf16"]


def test_parameter_count_is_hf_own():
    shape = model_spec(LLAMA_7B)
    assert shape.total == 6_738_415_616  # what HF's Llama-2-7B reports
    assert len(shape.per_layer) == 32 and shape.embedding == shape.output == 32000 * 4096


def test_mixture_of_experts_split_over_ep_and_only_active_experts_count_as_flops():
    from transformers import MixtralConfig

    from toolkit.estimate.flops import flops_per_token
    mixtral = MixtralConfig()  # 8x7B: 46.7B parameters, 12.9B active per token (Mistral AI's figures)
    shape = model_spec(mixtral)
    assert shape.experts == 8 and shape.experts_per_token == 2 and round(shape.total / 1e9, 1) == 46.7
    assert round((flops_per_token(shape, 0) / 6 + shape.embedding) / 1e9, 1) == 12.9
    held = {}
    for ep in (1, 8):
        cfg = load_config(None, [*BIG_RUN, "backend=megatron", f"megatron.ep={ep}"])
        held[ep] = memory(cfg, shape, check_layout(cfg, shape, 8))
    experts = sum(shape.per_layer_experts)
    assert held[1].params - held[8].params == pytest.approx(experts * 7 / 8)
    # each expert's optimizer state is sharded over the dp / ep = 1 replicas that hold it
    dense = held[8].params - experts / 8
    assert held[8].optimizer == pytest.approx(12 * (dense / 8 + experts / 8))


def test_zero_stages_and_offload_shrink_the_device_share():
    shape, cfg = model_spec(LLAMA_7B), load_config(None, BIG_RUN)
    states = []
    for stage in range(4):
        cfg.zero.stage = stage
        states.append(memory(cfg, shape, check_layout(cfg, shape, 8)).model_state)
    phi = shape.total
    assert states[0] == pytest.approx(16 * phi)  # bf16 weights + grads + fp32 master, m, v
    assert states[3] == pytest.approx(16 * phi / 8)  # the ZeRO paper's (2 + 2 + 12) / N_d
    assert states[0] > states[1] == states[2] > states[3]  # ZeRO-1 partitions gradients too (measured)
    cfg.zero.offload_optimizer = True
    off = memory(cfg, shape, check_layout(cfg, shape, 8))
    assert off.optimizer == 0 and off.host == pytest.approx(16 * phi / 8 - 2 * phi / 8)


def test_activation_checkpointing_and_tp_cut_activations():
    shape = model_spec(LLAMA_7B)
    cfg = load_config(None, BIG_RUN)
    mem = memory(cfg, shape, check_layout(cfg, shape, 8))
    assert mem.activations_ckpt < mem.activations_no_ckpt / 5
    mcfg = load_config(None, [*BIG_RUN, "backend=megatron", "megatron.tp=8"])
    tp8 = memory(mcfg, shape, check_layout(mcfg, shape, 8))
    assert tp8.activations_no_ckpt < mem.activations_no_ckpt / 2 and tp8.params < shape.total / 7


def test_sequence_parallel_splits_the_norm_activations():
    """Per token per layer, sequence parallelism moves the 4h norm tensors to 4h / t (the module docstring)."""
    shape = model_spec(LLAMA_7B)
    run = [*BIG_RUN, "backend=megatron", "megatron.tp=8", "train.global_batch_size=1"]  # 1 micro-batch in flight
    plain, sp = (load_config(None, run + extra) for extra in ([], ["megatron.sequence_parallel=true"]))
    a, b = (memory(c, shape, check_layout(c, shape, 8)) for c in (plain, sp))
    tokens, w = 4096, 2  # b x s, bf16
    assert a.activations_no_ckpt - b.activations_no_ckpt == pytest.approx(32 * tokens * w * 4 * 4096 * (1 - 1 / 8))
    assert b.activations_ckpt < a.activations_ckpt  # the kept layer inputs are split too


def test_megatron_attention_choice_sets_the_scores_and_kv_terms():
    """megatron.attention=local keeps the a x s scores and K/V repeated to every head; the toolkit's
    attention (sdpa/flex) neither (the module docstring's per-token terms)."""
    shape = model_spec(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000))
    run = [*BIG_RUN, "backend=megatron", "megatron.tp=8", "train.global_batch_size=1"]  # 1 micro-batch in flight
    own, local = (load_config(None, run + [f"megatron.attention={a}"]) for a in ("auto", "local"))
    a, b = (memory(c, shape, check_layout(c, shape, 8)) for c in (own, local))
    tokens, w, t = 4096, 2, 8
    per_token = (32 * 4096 + 2 * (4096 - 8 * 128)) / t  # scores (heads x s) + the repeated part of K and V
    assert b.activations_no_ckpt - a.activations_no_ckpt == pytest.approx(32 * tokens * w * per_token)
    assert a.activations_ckpt < b.activations_ckpt  # the one recomputed layer keeps no scores either


def test_suggestions_are_the_least_sharded_layouts_that_fit():
    shape, cfg = model_spec(LLAMA_7B), load_config(None, BIG_RUN)
    found = suggestions(cfg, shape, 8, device_gib=80)
    assert found and found[0][0].describe() == "ZeRO-1 dp=8 ckpt=none"  # ZeRO-0: 16 B/param, 100 GiB
    assert all(m.total <= 0.92 * 80 * GiB for _, m in found)
    # 8 GiB at seq 4096: only with everything sharded, the optimizer on the host and checkpointing
    assert [lay.describe() for lay, _ in suggestions(cfg, shape, 8, device_gib=8)][0] == "ZeRO-3+offload_opt dp=8 ckpt=full"
    assert suggestions(cfg, shape, 8, device_gib=2) == []


def test_collectives_follow_the_alpha_beta_formulas():
    alpha, beta, n = 1e-5, 1e10, 1e9
    assert collective_seconds("all-reduce", 8, n, alpha, beta) == pytest.approx(14 * alpha + 2 * 7 / 8 * n / beta)
    assert collective_seconds("all-gather", 8, n, alpha, beta) == pytest.approx(7 * alpha + 7 / 8 * n / beta)
    assert collective_seconds("p2p", 2, n, alpha, beta) == pytest.approx(alpha + n / beta)
    assert collective_seconds("all-reduce", 1, n, alpha, beta) == 0


def test_communication_share_grows_when_dp_crosses_nodes():
    shape = model_spec(LLAMA_7B)
    cfg = load_config(None, [*BIG_RUN, "zero.stage=3"])
    one = step_time(cfg, shape, check_layout(cfg, shape, 8), Cluster(nodes=1))
    four = step_time(cfg, shape, check_layout(cfg, shape, 32), Cluster(nodes=4))
    assert not any(c.inter_node for c in one.collectives) and all(c.inter_node for c in four.collectives)
    assert four.comm_share > one.comm_share and math.isclose(four.compute_s * 4, one.compute_s)


def test_estimate_cli_json_and_exit_codes():
    fits = run_cli(["estimate", "--json", "--device-memory", "16"])
    result = json.loads(fits.stdout)
    assert result["fits"] and result["layout_text"] == "ZeRO-2 dp=2 ckpt=none" and result["model"]["params"] == 1_262_720
    tight = run_in_process(["estimate", "--device-memory", "0.001", "--set", "zero.stage=3"], check=False)
    assert tight.returncode == 3 and "does NOT fit in 0.001 GiB" in tight.stdout
    bad = run_in_process(["estimate", "--cluster", "inter_gbs=50"], check=False)
    assert bad.returncode == 2 and "--cluster 'inter_gbs=50': expected KEY=VALUE with KEY one of nodes" in bad.stderr


def test_dry_run_prints_resolved_deepspeed_json_and_starts_nothing(capsys, tmp_path):
    run_dir = tmp_path / "never"
    assert main(["train", "--dry-run", "--run-dir", str(run_dir), "--set", "zero.ds_config=zero3_offload"]) == 0
    out = capsys.readouterr().out
    ds = json.loads(out.split("# DeepSpeed config (RUN_DIR/ds_config.json)\n")[1].split("\n# estimate")[0])
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "stage: 3" in out and "ZeRO-3+offload_opt+offload_params dp=2" in out and "no process group was started" in out
    assert not run_dir.exists()


def test_dry_run_megatron_prints_the_layout(capsys):
    assert main(["train", "--dry-run", "--nproc", "4", "--set", "backend=megatron", "--set", "megatron.preset=tp2_pp2"]) == 0
    out = capsys.readouterr().out
    layout = json.loads(out.split("# layout at 4 rank(s)\n")[1].split("\n# estimate")[0])
    assert {k: layout[k] for k in ("tp", "pp", "vpp", "ep", "dp", "sequence_parallel", "padded_vocab")} == \
        {"tp": 2, "pp": 2, "vpp": None, "ep": 1, "dp": 1, "sequence_parallel": False, "padded_vocab": 2048}


@pytest.mark.parametrize("sets, message", [
    (["backend=megatron", "megatron.tp=3", "nproc=3"],
     "num_attention_heads=4 is not divisible by megatron.tp=3; choose tp in [1, 2]"),
    (["backend=megatron", "megatron.tp=3"],
     "world size 2 is not divisible by megatron.tp=3 x megatron.pp=1; choose tp x pp in [1, 2]"),
    (["train.micro_batch_size=3"], "train.global_batch_size=16 is not divisible by train.micro_batch_size=3 x dp=2"),
    (["zero.offload_params=true"], "zero.offload_params needs ZeRO stage 3, got zero.stage=2"),
    (["train.steps=0"], "train.steps=0 must be >= 1"),
])
def test_dry_run_errors_name_field_value_constraint_and_fix(capsys, sets, message):
    args = ["train", "--dry-run"] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 2
    assert message in capsys.readouterr().err


MODEL_STATE_RATIO = (0.99, 1.02)
"""measured / estimated model state, what README promises ("within 2%"). Measured: ZeRO-0 1.004,
ZeRO-1/2 1.005, ZeRO-3 1.013, Megatron TP2 1.001, PP2 1.001-1.003 (never below 1: the estimate
leaves out small allocations, e.g. DeepSpeed's flat-buffer padding)."""


@pytest.mark.slow
def test_model_state_within_2_percent_of_what_real_engines_hold(tmp_path):
    """ZeRO 0-3 (DeepSpeed's own JSON with "auto" buckets) and Megatron TP2 / PP2, 2 ranks each."""
    model = tmp_path / "model"
    model.mkdir()
    hf = json.loads((REPO / "toolkit/demo/tiny-llama/config.json").read_text())
    hf.update(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    (model / "config.json").write_text(json.dumps(hf))
    base = [f"model.name_or_path={model}", "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1"]
    configs = [base + [f"zero.stage={s}", f"zero.ds_config={_auto_buckets(tmp_path, s)}"] for s in range(4)]
    configs += [base + ["backend=megatron", "megatron.tp=2"], base + ["backend=megatron", "megatron.pp=2"]]
    rows = _measure(tmp_path, configs)
    for overrides, rank, measured in rows:
        cfg = load_config(None, overrides)
        spec = model_spec(_hf(cfg))
        lay = check_layout(cfg, spec, 2)
        est = memory(cfg, spec, lay) if lay.pp == 1 else _stage_memory(cfg, lay, rank)
        ratio = measured / est.model_state
        print(f"{lay.describe():32s} rank {rank}: estimated {est.model_state / 2**20:7.2f} MiB, "
              f"measured {measured / 2**20:7.2f} MiB ({ratio:.3f})")
        assert MODEL_STATE_RATIO[0] <= ratio <= MODEL_STATE_RATIO[1], (lay.describe(), rank, ratio)


@pytest.mark.slow
def test_lora_model_state_against_what_real_engines_hold(tmp_path):
    """LoRA (rank 32, all-linear) on ZeRO-2, ZeRO-3 and Megatron TP2, 2 ranks each: the frozen base's
    weights plus the adapters' weights, gradients and Adam state, against what the engines hold
    (the plan's LoRA formula was only ever restated by its tests). Measured: ZeRO-2 +0.25 MiB
    (1.011), ZeRO-3 +0.51 MiB (1.038): the same few allocations full fine-tuning's ratios show
    (1.005, 1.013 of a larger state), so judged in bytes against full fine-tuning's 2%. Megatron
    counts every adapter whole on each TP rank (``estimate/memory.py``: an upper bound, about half of
    them is TP-split): measured 2.80 MiB (0.833) under it, within the split half's 4.56 MiB."""
    from toolkit.plan import build_plan
    model = tmp_path / "model"
    model.mkdir()
    hf = json.loads((REPO / "toolkit/demo/tiny-llama/config.json").read_text())
    hf.update(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    (model / "config.json").write_text(json.dumps(hf))
    base = [f"model.name_or_path={model}", "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
            "lora.rank=32"]
    configs = [base + [f"zero.stage={s}", f"zero.ds_config={_auto_buckets(tmp_path, s)}"] for s in (2, 3)]
    configs += [base + ["backend=megatron", "megatron.tp=2"]]
    bad = {}
    for overrides, rank, measured in _measure(tmp_path, configs):
        plan = build_plan(load_config(None, overrides), [2])
        lay = plan.layout(2)
        est = memory(plan.config, plan.model, lay, lora_trainable=plan.lora.trainable).model_state
        full = memory(plan.config, plan.model, lay).model_state
        gap = measured - est
        print(f"LoRA {lay.describe():32s} rank {rank}: estimated {est / 2**20:7.2f} MiB (full fine-tuning's "
              f"{full / 2**20:7.2f}), measured {measured / 2**20:7.2f} MiB ({measured / est:.3f}; "
              f"{gap / 2**20:+.2f} MiB)")
        if plan.config.backend == "megatron":
            split_half = plan.lora.trainable * (4 + 4 + 8) / 2  # weights, fp32 grads, Adam m and v (fp32 model)
            ok = -split_half <= gap <= 0
        else:
            ok = 0 <= gap <= (MODEL_STATE_RATIO[1] - 1) * full
        if not ok:
            bad[(lay.describe(), rank)] = gap / 2**20
    assert not bad, bad


def _auto_buckets(tmp_path, stage: int) -> str:
    ds = json.loads((REPO / f"ds_configs/zero{stage}.json").read_text())
    ds["zero_optimization"]["reduce_bucket_size"] = "auto"  # hidden^2, not DeepSpeed's 2 GB default
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps(ds))
    return str(path)


def _measure(tmp_path, configs: list[list[str]]) -> list[tuple[list[str], int, int]]:
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    out = tmp_path / "measured.json"
    run_cli(["supervise", "--nproc", "2", "--run-dir", str(tmp_path / "sup"), "--",
             str(REPO / "tests/scripts/measure_memory.py"), str(out), str(tmp_path / "configs.json")])
    rows = []
    for rank in (0, 1):
        for r in json.loads(out.with_name(f"{out.name}.{rank}").read_text()):
            rows.append((r["overrides"], rank, r["step_bytes"]))
    return rows


def _hf(cfg):
    from toolkit.plan.model import load_hf_config
    return load_hf_config(cfg.model.name_or_path)


def _stage_memory(cfg, lay, rank: int):
    from toolkit.estimate.memory import DTYPE_BYTES, _megatron_stage_memory
    return _megatron_stage_memory(cfg, model_spec(_hf(cfg)), lay, DTYPE_BYTES[cfg.model.dtype], rank)


def test_activation_model_within_8_percent_of_what_autograd_saves():
    """The demo Llama, one micro-batch of 4 x 256 tokens, fp32: bytes autograd saves for backward
    (saved-tensor hooks; weights excluded) against the per-layer activation model."""
    from toolkit.adapters.hf import build_model
    from toolkit.estimate.memory import _activations
    from toolkit.plan import build_plan
    cfg = load_config(None, ["data.seq_len=256", "train.micro_batch_size=4"])
    measured = _saved_for_backward(build_model(build_plan(cfg, [2])))
    shape = model_spec(_hf(cfg))
    estimated = _activations(cfg, shape, list(range(shape.layers)), 1, 1, "none", 4, materialized=False)
    print(f"layers: estimated {estimated / 2**20:.1f} MiB, autograd saved {measured / 2**20:.1f} MiB")
    assert 0.97 <= measured / estimated <= 1.08  # measured 1.043 (41.7 MiB saved, 40.0 MiB estimated)


# --- host memory at load and export, logits and loss (issue 18) ---------------------------------------

LAMBDA_7B = 32000 * 4096  # the largest tensor: embedding and LM head [V, h] (the MLP's is 11008 x 4096)


def _at(cfg, world=8):
    shape = model_spec(LLAMA_7B)
    return shape, memory(cfg, shape, check_layout(cfg, shape, world))


@pytest.mark.parametrize("stage, share", [(3, 2 * 6_738_415_616 / 8), (2, 2 * 6_738_415_616), (0, 2 * 6_738_415_616)])
def test_host_memory_at_load_and_export_on_deepspeed(stage, share):
    """ZeRO-3: the rank's partition plus one tensor, never the model; ZeRO 0-2: one bf16 copy plus one
    tensor. Load stages a tensor in fp32 (4 bytes), export holds it in bf16 and in fp32 (2 + 4)."""
    shape, mem = _at(load_config(None, [*BIG_RUN, f"zero.stage={stage}"]))
    assert shape.total == 6_738_415_616 and mem.largest_tensor == LAMBDA_7B
    assert mem.host_load == pytest.approx(share + 4 * LAMBDA_7B)
    assert mem.host_export == pytest.approx(share + 6 * LAMBDA_7B)
    if stage == 3:
        assert mem.host_load < 2.3e9  # 1.68 GB of partition + 0.52 GB: not the 13.5 GB bf16 model


def test_host_memory_counts_offloaded_state_once():
    shape, mem = _at(load_config(None, [*BIG_RUN, "zero.stage=3", "zero.offload_optimizer=true",
                                        "zero.offload_params=true"]))
    phi = shape.total
    assert mem.host == pytest.approx((2 + 2 + 12) * phi / 8)  # weights, gradients, master + Adam: on the host
    assert mem.host_load == pytest.approx(mem.host + 4 * LAMBDA_7B)  # the partition is in ``host`` already


def test_host_memory_on_megatron_is_the_tp_pp_share_plus_one_tensor():
    shape, mem = _at(load_config(None, [*BIG_RUN, "backend=megatron", "megatron.tp=4", "megatron.pp=2"]))
    assert mem.params < shape.total / 7  # one eighth of the model, plus norms replicated over TP
    assert mem.host_load == pytest.approx(2 * mem.params + 4 * LAMBDA_7B)
    assert mem.host_export == pytest.approx(2 * mem.params + 6 * LAMBDA_7B)


def test_logits_and_loss_memory_with_the_chunked_loss():
    """N = 4096 tokens, V = 32000, bf16: the logits and their gradient in bf16 plus three fp32 chunks
    of 2096 rows (256 MiB each at most); megatron's loss keeps three fp32 [N, V / t]."""
    from toolkit.loss import loss_chunk_rows
    n, v = 4096, 32000
    assert loss_chunk_rows(v) == 2096
    _, mem = _at(load_config(None, BIG_RUN))
    assert mem.logits_loss == 2 * 2 * n * v + 3 * 4 * 2096 * v
    _, long = _at(load_config(None, [*BIG_RUN, "data.seq_len=32768"]))  # 8x the tokens: only the bf16 part grows
    assert long.logits_loss == 2 * 2 * 8 * n * v + 3 * 4 * 2096 * v < 3 * 4 * 8 * n * v / 2  # < half the old 3 fp32 copies
    _, meg = _at(load_config(None, [*BIG_RUN, "backend=megatron", "megatron.tp=8"]))
    assert meg.logits_loss == 3 * 4 * n * v / 8


def test_logits_and_loss_formula_matches_the_allocator():
    """The formula against what torch allocates for the loss (its profiler's memory events): the bf16
    logits, then the loss's peak during forward and backward, for one chunk and for several."""
    import torch

    from toolkit.estimate.memory import chunked_loss_bytes
    from toolkit.loss import token_loss_sum
    b, s, v = 2, 256, 4099
    shape = model_spec(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=v))
    cfg = load_config(None, [f"data.seq_len={s}", f"train.micro_batch_size={b}"])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s, v, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, v, (b, s), generator=gen)
    for rows, formula in ((None, chunked_loss_bytes(cfg, shape, 2)), (64, 2 * 2 * b * s * v + 3 * 4 * 64 * v)):
        peak, _ = loss_allocations(token_loss_sum, logits, labels, chunk_rows=rows)
        measured = logits.nbytes + peak
        assert 0.99 <= measured / formula <= 1.01, (rows, measured, formula)


def test_estimate_shows_host_memory_and_logits(capsys):
    assert main(["estimate", "--device-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "host memory at load" in out and "host memory at export" in out and "of which logits and loss" in out
    result = json.loads(run_cli(["estimate", "--json", "--device-memory", "16"]).stdout)["memory"]
    assert result["host_load"] > result["weights"] > 0 and result["host_export"] > result["host_load"]
    assert 0 < result["logits_loss"] < result["activations"] and result["largest_tensor"] == 2048 * 128


def test_tiled_loss_formula_matches_the_allocator():
    """``zero.tiled_loss``: what torch allocates in the tiled loss's forward and backward (the lm_head
    per tile, no [N, V] logits) against (w + 3·4)·min(N, r)·V + w·N·h (+ w·V·h), for one tile and for
    several; the head weight's gradient (model state's) left out. Before the loss freed each tile's
    logits and gradients ahead of the next tile, several tiles measured 4.57 MiB against 3.57."""
    import torch

    from toolkit.estimate.memory import tiled_loss_bytes
    from toolkit.loss import tiled_token_loss_sum
    b, s, v, h = 2, 256, 4099, 64
    shape = model_spec(LlamaConfig(hidden_size=h, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=v))
    cfg = load_config(None, [f"data.seq_len={s}", f"train.micro_batch_size={b}"])
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(h, v, bias=False).to(torch.bfloat16)
    hidden = torch.randn(b, s, h, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, v, (b, s), generator=gen)
    several = (2 + 12) * 48 * v + 2 * b * s * h + 2 * v * h  # 48-token tiles: and one tile's head gradient
    for rows, formula in ((None, tiled_loss_bytes(cfg, shape, 2)), (48, several)):
        peak, _ = loss_allocations(lambda x, y, rows: tiled_token_loss_sum(x, head, y, rows=rows), hidden, labels,
                                   rows=rows)
        measured = peak - head.weight.nbytes
        print(f"rows {rows}: measured {measured / 2**20:.2f} MiB, formula {formula / 2**20:.2f} MiB")
        assert 0.95 <= measured / formula <= 1.05, (rows, measured, formula)


def test_tiled_mlp_activations_match_what_autograd_saves():
    """``zero.tiled_mlp`` on the demo Llama (4 x 256 tokens, hidden 128: 2 tiles): the bytes autograd
    saves for backward fall by what the activation model says the MLPs' intermediates take (TiledMLP
    keeps its input only). Measured: 41.7 -> 19.7 MiB saved, 40.0 -> 18.0 MiB estimated (the model's
    constant 1.7 MiB short either way)."""
    from toolkit.adapters.deepspeed.tiles import tile_mlps
    from toolkit.adapters.hf import build_model
    from toolkit.estimate.memory import _activations, mlp_tile_count
    from toolkit.plan import build_plan
    cfg = load_config(None, ["data.seq_len=256", "train.micro_batch_size=4"])
    untiled = _saved_for_backward(build_model(build_plan(cfg, [2])))
    model = build_model(build_plan(cfg, [2]))
    tile_mlps(model)
    tiled = _saved_for_backward(model)
    shape = model_spec(_hf(cfg))
    tiles = mlp_tile_count(cfg, shape)
    one_tile = (4 if shape.glu else 2) * shape.mlp_width * 4 * 256 / tiles * 4  # alive in backward, not saved
    model_tiled = _activations(cfg, shape, list(range(shape.layers)), 1, 1, "none", 4, materialized=False,
                               mlp_tiles=tiles) - one_tile
    model_untiled = _activations(cfg, shape, list(range(shape.layers)), 1, 1, "none", 4, materialized=False)
    print(f"tiled MLPs ({tiles} tiles): autograd saved {untiled / 2**20:.1f} -> {tiled / 2**20:.1f} MiB, estimated "
          f"{model_untiled / 2**20:.1f} -> {model_tiled / 2**20:.1f} MiB")
    assert tiles == 2
    assert (untiled - tiled) / (model_untiled - model_tiled) == pytest.approx(1, abs=0.03)
    assert 0.97 <= tiled / model_tiled <= 1.12


def _saved_for_backward(model) -> int:
    """Bytes autograd saves in the forward and loss of a 4 x 256 batch (saved-tensor hooks), weights and
    the loss's fp32 logits left out."""
    import torch

    from toolkit.loss import token_loss_sum
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    ids = torch.randint(0, 2048, (4, 256), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_loss_sum(model(input_ids=ids).logits, ids)
    return sum(n for ptr, n in saved.items() if ptr not in weights) - 4 * 256 * 2048 * 4
