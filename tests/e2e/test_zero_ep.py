"""``zero.ep`` (DeepSpeed's AutoEP) through ``toolkit train``'s ranks on 2 gloo ranks, in strict device mode,
against ZeRO-2 DP=2 of the same model (fp32, the demo corpus packed by documents, micro-batches of 2 rows,
2 micro-batches per rank, eval on): per-parameter gradients of step 1 (the aux loss's included), losses,
aux loss, routing, grad norm and eval loss, for mixtral, qwen2_moe (gated shared expert, tied embeddings,
activation checkpointing; also at DP=4, two expert-data-parallel replicas) and qwen3_moe, at ZeRO-2, ZeRO-3
(built under zero.Init), ZeRO-1 and ZeRO-0 (whose grad norm the toolkit takes itself); a router that leaves
one EP rank without tokens. Then checkpoints: resumed at the same layout (exact) and at other layouts and
ep (converted) on the loss curve, read by the converter as DeepSpeed's ``ds_to_universal`` consolidates
them, converted to HF (equal to ``hf_final/``, itself equal to the DP run's), to megatron EP=2 and from
ep=1 to a zero.ep checkpoint with ``--verify``."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.runs import losses, refused, resumes, run_in_process, train, train_args, worker_ranks
from toolkit.observe.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
RUN = ["train.steps=4", "train.eval_every=3", "data.packing=documents", "train.moe_aux_loss_coeff=0.1",
       "train.lr=1e-3", "train.warmup_steps=0", "checkpoint.every=100"]
CASES = {  # name: (family, overrides); each ep=2 case is compared with the ZeRO-2 ep=1 run of its family
    "mixtral_dp2": ("mixtral", ["zero.stage=2", "checkpoint.every=2"]),
    "mixtral_ep2": ("mixtral", ["zero.stage=2", "zero.ep=2", "checkpoint.every=2"]),
    "mixtral_ep2_zero3": ("mixtral", ["zero.stage=3", "zero.ep=2", "checkpoint.every=2"]),
    "mixtral_ep2_zero0": ("mixtral", ["zero.stage=0", "zero.ep=2", "train.export_hf=false"]),  # the toolkit's norm
    "qwen2_moe_dp2": ("qwen2_moe", ["zero.stage=2", "model.activation_checkpointing=true"]),
    "qwen2_moe_ep2": ("qwen2_moe", ["zero.stage=2", "zero.ep=2", "model.activation_checkpointing=true"]),
    "qwen2_moe_ep2_dp4": ("qwen2_moe", ["zero.stage=2", "zero.ep=2", "checkpoint.every=2", "nproc=4"]),
    # (its reference qwen2_moe_dp2 runs at DP=2: the same global batch of 8 rows, 1 micro-batch per rank)
    "qwen3_moe_dp2": ("qwen3_moe", ["zero.stage=2"]),
    "skewed_dp2": ("skewed", ["zero.stage=3", "model.init=pretrained"]),  # (its ep=2 run is at ZeRO-3 too)
    "skewed_ep2_zero3": ("skewed", ["zero.stage=3", "zero.ep=2", "model.init=pretrained"]),  # EP rank 1: no tokens
    "qwen3_moe_ep2_zero1": ("qwen3_moe", ["zero.stage=1", "zero.ep=2"]),
}
GRAD_RTOL = 1e-6
"""Per parameter, |ep2 - dp2| / |dp2| (L2) of step 1's gradient (all-to-all reorders the sums); measured worst
4.9e-7 (qwen2_moe's layers.1.self_attn.k_proj.bias), 2.5e-7 to 3.6e-7 for the other cases (printed by
``test_ep2_gives_dp2s_gradients_and_losses``). Expert gradients scaled by 2 fail it (gap 1.0) while the
losses still match: Adam is blind to a uniform gradient scale."""
SKEWED_GRAD_RTOL = 1e-5
"""The skewed-router model (``_skewed_mixtral``: one dominant hidden dimension) is ill-conditioned: its
attention gradients nearly cancel, so fp32 reordering shows more; measured worst 2.1e-6 (layers.0.self_attn.
k_proj.weight; 3.6e-6 against ZeRO-2), still five orders below the mutation's 1.0."""
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A config.json per family (random init from train.seed): the tiny configs, the demo's vocabulary."""
    from toolkit.families.tiny import TINY_MOE
    root, out = tmp_path_factory.mktemp("zero_ep_models"), {}
    for family, arch in FAMILIES.items():
        config = {k: v for k, v in TINY_MOE[family].items() if k != "sliding_window"}
        config.update(vocab_size=2048, max_position_embeddings=128, architectures=[arch])
        (root / family).mkdir()
        (root / family / "config.json").write_text(json.dumps(config))
        out[family] = root / family
    out["skewed"] = _skewed_mixtral(root / "skewed")
    return out


def _skewed_mixtral(path):
    """A pretrained tiny Mixtral whose routers never pick experts 2 and 3: every token's embedding has a
    large positive hidden dimension 0, which the residual stream keeps, and the routers' rows of experts 2
    and 3 see only that dimension, with a large negative weight. At ep=2 the second EP rank receives no
    token in any layer; its experts run on empty groups and get zero gradients."""
    from toolkit.families.tiny import tiny_model
    model = tiny_model("mixtral", vocab_size=2048, max_position_embeddings=128, sliding_window=None)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.mlp.gate.weight[2:] = 0.0
            layer.mlp.gate.weight[2:, 0] = -50.0
    model.save_pretrained(path)
    return path


def _capture_step1_grads(rank, run_dir):
    """Inside a rank: step 1's whole gradients (DeepSpeed's ``safe_get_full_grad`` at the accumulation
    boundary, before the optimizer steps; an AutoEP rank's experts all-gathered over the EP group, which
    is the world here) saved by rank 0 to RUN_DIR/grads_step1.pt under the module's own names."""
    from toolkit.adapters.deepspeed import engine as ds_engine
    original, grads = ds_engine.DeepSpeedEngine.train_step, {}

    def train_step(self, micro_batches, loss_tokens, lr):
        if grads:
            return original(self, micro_batches, loss_tokens, lr)
        step = self.engine.step

        def capturing_step():
            if self.engine.is_gradient_accumulation_boundary():
                grads.update(_full_grads(self.engine.module))
            step()
        self.engine.step = capturing_step
        try:
            return original(self, micro_batches, loss_tokens, lr)
        finally:
            del self.engine.step
    ds_engine.DeepSpeedEngine.train_step = train_step

    def save():
        if rank == 0:
            torch.save(grads, run_dir / "grads_step1.pt")
    return save


def _full_grads(module) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    out = {}
    for name, param in module.named_parameters():
        grad = safe_get_full_grad(param).detach().float().contiguous()
        if getattr(param, "allreduce", True) is False:  # an AutoEP expert: this rank's experts
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, grad)  # ranks 0 .. ep-1 are the first EP group (DeepSpeed's ep-fastest order)
            grad = torch.cat(parts[:int(param.group_name.removeprefix("ep_size_"))])
        out[name] = grad.cpu().clone()
    return out


def as_transformers(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """AutoEP's names and expert tensors as transformers has them (written here, apart from the toolkit's
    table, from AutoEP's ``auto_ep_layer``: w1 = gate rows, w3 = up rows, w2 = down; the router under
    ``router.gate`` and its alias ``gate.gate``)."""
    out = {}
    for name, g in grads.items():
        if name.endswith(".experts.w1"):
            out[name[:-2] + "gate_up_proj"] = torch.cat([g, grads[name[:-2] + "w3"]], dim=1)
        elif name.endswith(".experts.w2"):
            out[name[:-2] + "down_proj"] = g
        elif not name.endswith((".experts.w3", ".mlp.gate.gate.weight")):
            out[name.replace(".mlp.router.gate.", ".mlp.gate.").replace(".shared_experts", ".shared_expert")] = g
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache, model_dirs):
    root, done = tmp_path_factory.mktemp("zero_ep_runs"), {}

    def get(name: str):
        if name not in done:
            family, overrides = CASES[name]
            nproc = 4 if "nproc=4" in overrides else 2
            codes = worker_ranks(root / name, data_cache, _capture_step1_grads, *RUN,
                                 f"model.name_or_path={model_dirs[family]}", *overrides, nproc=nproc)
            assert codes == [0] * nproc, f"{name}: ranks exited {codes}"
            done[name] = root / name
        return done[name]
    return get


def records(run_dir):
    return [r for _, r in sorted(read_metrics(run_dir).items())]


def grad_gaps(ep_run, dp_run) -> dict[str, float]:
    got = as_transformers(torch.load(ep_run / "grads_step1.pt"))
    want = torch.load(dp_run / "grads_step1.pt")
    assert sorted(got) == sorted(want)
    return {n: ((got[n] - w).norm() / w.norm()).item() for n, w in want.items() if w.norm() > 0}


def eval_loss(run_dir) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


@pytest.mark.parametrize("ep_case", [c for c in CASES if "_ep2" in c])
def test_ep2_gives_dp2s_gradients_and_losses(runs, ep_case):
    family = CASES[ep_case][0]
    dp, ep = runs(f"{family}_dp2"), runs(ep_case)
    gaps = grad_gaps(ep, dp)
    worst = max(gaps, key=gaps.get)
    a, b = records(dp), records(ep)
    loss_gap = max(abs(y["loss"] - x["loss"]) / x["loss"] for x, y in zip(a, b))
    aux_gap = max(abs(y["moe_aux_loss"] - x["moe_aux_loss"]) / x["moe_aux_loss"] for x, y in zip(a, b))
    print(f"\n{ep_case} vs {family}_dp2: worst grad gap {gaps[worst]:.2e} ({worst}), loss {loss_gap:.1e}, "
          f"aux {aux_gap:.1e}, eval {abs(eval_loss(ep) / eval_loss(dp) - 1):.1e}")
    assert gaps[worst] <= (SKEWED_GRAD_RTOL if family == "skewed" else GRAD_RTOL), f"{worst}: {gaps[worst]:.3e}"
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=LOSS_RTOL)
        assert y["moe_aux_loss"] == pytest.approx(x["moe_aux_loss"], rel=LOSS_RTOL)
        assert y["moe_expert_tokens"] == x["moe_expert_tokens"]  # the same routing decisions
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    if "nproc=4" not in CASES[ep_case][1]:  # DP=4 evaluates the eval rows its 4 ranks take (another count)
        assert eval_loss(ep) == pytest.approx(eval_loss(dp), rel=LOSS_RTOL)
    setup = [json.loads(line) for line in (ep / "metrics.jsonl").read_text().splitlines()]
    assert {"event": "moe", "expert_parallel": "deepspeed_autoep", "ep": 2, "experts": 4, "experts_per_rank": 2,
            "moe_layers": 2}.items() <= next(r for r in setup if r.get("event") == "moe").items()


def test_an_ep_rank_without_tokens_trains_at_zero3(runs):
    """No hang, and the idle rank's experts take zero gradients: every token went to experts 0 and 1."""
    for record in records(runs("skewed_ep2_zero3")):
        assert all(layer[2] == layer[3] == 0 and sum(layer) > 0 for layer in record["moe_expert_tokens"])
    grads = as_transformers(torch.load(runs("skewed_ep2_zero3") / "grads_step1.pt"))
    assert not grads["model.layers.0.mlp.experts.gate_up_proj"][2:].any()
    assert grads["model.layers.0.mlp.experts.gate_up_proj"][:2].any()


def test_hf_final_of_ep2_is_the_dp_runs(runs):
    """transformers' names and shapes, every expert, equal to the DP=2 run's export after 4 steps."""
    from safetensors.torch import load_file
    dp = load_file(runs("mixtral_dp2") / "hf_final" / "model.safetensors")
    ep = load_file(runs("mixtral_ep2") / "hf_final" / "model.safetensors")
    assert sorted(ep) == sorted(dp)
    assert all(ep[n].shape == dp[n].shape for n in dp)
    gaps = {n: ((ep[n] - t).norm() / t.norm()).item() for n, t in dp.items()}
    worst = max(gaps, key=gaps.get)
    print(f"\nhf_final mixtral ep2 vs dp2 after 4 steps: worst {gaps[worst]:.2e} ({worst})")
    assert gaps[worst] <= 1e-5


def _resumed(tmp_path, data_cache, model_dirs, full, family: str, *overrides: str):
    """The step-2 checkpoint of the run in ``full`` resumed in a new run directory with ``overrides``."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "step_00000002", run_dir / "checkpoints" / "step_00000002")
    train(run_dir, data_cache, *RUN, f"model.name_or_path={model_dirs[family]}", *overrides)
    return run_dir


@pytest.mark.parametrize("source, overrides, how", [
    ("mixtral_ep2", CASES["mixtral_ep2"][1], "as saved"),  # DeepSpeed loads it: bit for bit
    ("mixtral_ep2", ["zero.stage=3"], "converted"),  # ep=2 -> ep=1 ZeRO-3: the converter reads AutoEP's files
    ("mixtral_dp2", ["zero.stage=3", "zero.ep=2"], "converted"),  # ep=1 -> ep=2 ZeRO-3: and writes them
    ("qwen2_moe_ep2_dp4", ["zero.stage=1", "zero.ep=2"], "converted"),  # 2 expert-DP replicas -> 1, ZeRO-1
])
def test_checkpoint_resumes_at_any_layout_on_the_loss_curve(runs, tmp_path, data_cache, model_dirs, source,
                                                            overrides, how):
    """Steps 3 and 4 of the resumed run against the run that went on (step 4's loss follows the resumed
    step's Adam update: moments included)."""
    full = runs(source)
    resumed = _resumed(tmp_path, data_cache, model_dirs, full, CASES[source][0], *overrides)
    assert resumes(resumed)[0][2] == how
    if how == "as saved":
        assert losses(resumed) == losses(full)[2:]
    else:
        assert losses(resumed) == pytest.approx(losses(full)[2:], rel=1e-6)


def test_bad_ep_is_refused_before_launch(tmp_path, data_cache, model_dirs):
    code, _, err = refused(train_args(tmp_path / "bad", data_cache, *RUN, f"model.name_or_path={model_dirs['mixtral']}",
                                      "zero.ep=3"))
    assert code == 2 and "4 experts do not divide over zero.ep=3; choose zero.ep in [1, 2]" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", ["mixtral_ep2", "mixtral_ep2_zero3", "qwen2_moe_ep2_dp4"])
def test_reader_equals_ds_to_universal(runs, tmp_path, case):
    """The converter's reading of an AutoEP checkpoint (ZeRO-2 with one and with two expert-data-parallel
    ranks, ZeRO-3) equals DeepSpeed's own consolidation, ``ds_to_universal``: weights and Adam moments, exact."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from toolkit.families import get_family, unpack
    from toolkit.formats.canonical import hf_config_object
    from toolkit.formats.zero import ZeroSource
    tag = runs(case) / "checkpoints" / "step_00000002" / "engine" / "global_step2"
    hf = json.loads((runs(case) / "checkpoints" / "step_00000002" / "config.json").read_text())
    ds_to_universal(Namespace(input_folder=str(tag), output_folder=str(tmp_path / "u"), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    source = ZeroSource(tag, hf)
    config, family = hf_config_object(hf), get_family(hf["model_type"])
    flat = {k.replace(".mlp.gate.", ".mlp.router.gate.").replace(".shared_expert", ".shared_experts"): s
            for k, s in source.index.shapes.items()}
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        universal = {}
        for folder in sorted((tmp_path / "u" / "zero").iterdir()):
            if (folder / f"{state}.pt").is_file():
                t = torch.load(folder / f"{state}.pt", weights_only=False)
                t = t["param"] if isinstance(t, dict) else t  # a stage-3 source gives flat tensors
                universal[folder.name] = t.reshape(flat[folder.name]) if folder.name in flat else t
        want = unpack(family, config, as_transformers(universal))
        if config.tie_word_embeddings:
            want.pop("lm_head.weight", None)
        assert sorted(want) == sorted(source.infos)
        differ = [n for n in want if not torch.equal(source.read(n, "param" if state == "fp32" else state), want[n])]
        assert not differ, f"{state}: {differ[:5]}"


def test_convert_to_hf_and_megatron_ep2_with_verify(runs, tmp_path):
    """``toolkit convert`` of the ep=2 run's last checkpoint: to HF (equal to its hf_final/ and the
    converter's --verify), to megatron at EP=2 (--verify: tensors, moments, logits)."""
    from safetensors.torch import load_file
    run = runs("mixtral_ep2")
    ckpt = run / "checkpoints" / "step_00000004"
    run_in_process(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--verify"])
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), load_file(run / "hf_final" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    out = run_in_process(["convert", str(ckpt), str(tmp_path / "megatron"), "--to", "megatron", "--ep", "2",
                          "--verify"])
    assert "verify: OK" in out.stdout and "optimizer moments: 0 compared" not in out.stdout
    dense = runs("mixtral_dp2") / "checkpoints" / "step_00000004"
    out = run_in_process(["convert", str(dense), str(tmp_path / "autoep"), "--to", "zero", "--ep", "2", "--dp", "2",
                          "--verify"])  # and an ep=1 checkpoint as a zero.ep run's, read back
    assert "verify: OK" in out.stdout and "optimizer moments: 0 compared" not in out.stdout
