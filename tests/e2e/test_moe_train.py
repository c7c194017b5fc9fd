"""Mixture of experts end to end through `toolkit train` and `toolkit convert` (tiny Mixtral, 4 experts
top-2, the demo corpus): megatron at EP=2 and DeepSpeed ZeRO-3 give the same losses, aux loss and
routing; a megatron checkpoint resumes at another EP; ZeRO <-> megatron conversions across EP sizes
are exact and resume on the loss curve."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.runs import losses, refused, resumes, run_in_process, train, train_args
from toolkit.observe.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 2048, "max_position_embeddings": 128, "num_local_experts": 4, "num_experts_per_tok": 2,
           "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "pad_token_id": 0}
STEPS = ["train.steps=4", "checkpoint.every=2", "train.eval_every=2"]
EP2 = ["backend=megatron", "megatron.ep=2"]
K = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    (path / "config.json").write_text(json.dumps(MIXTRAL))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache, model_dir):
    cache, root = {}, tmp_path_factory.mktemp("moe_runs")

    def get(name: str, *overrides: str):
        if name not in cache:
            train(root / name, data_cache, *STEPS, f"model.name_or_path={model_dir}", *overrides)
            cache[name] = root / name
        return cache[name]
    return get


def records(run_dir):
    return [r for _, r in sorted(read_metrics(run_dir).items())]


def test_megatron_ep2_and_deepspeed_zero3_agree_aux_loss_included(runs):
    zero3, ep2 = records(runs("zero3", "zero.stage=3")), records(runs("ep2", *EP2))
    assert len(zero3) == len(ep2) == 4
    gaps = {k: max(abs(b[k] - a[k]) / abs(a[k]) for a, b in zip(zero3, ep2))
            for k in ("loss", "moe_aux_loss", "grad_norm")}
    print(f"\nmax relative gap megatron EP=2 vs ZeRO-3: {gaps}")  # README quotes this
    for a, b in zip(zero3, ep2):
        assert b["loss"] == pytest.approx(a["loss"], rel=3e-7)  # measured 4.8e-8
        assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], rel=3e-7)  # measured 4.4e-8
        assert b["moe_expert_tokens"] == a["moe_expert_tokens"]  # the same routing decisions
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=3e-5)  # measured 3.9e-6
        assert sum(a["moe_expert_tokens"][0]) == 8 * 32 * 2  # global batch x seq x top-k, per layer
        assert a["moe_load_max"] >= 1.0 and 1.0 < a["moe_aux_loss"] < 4.0  # 2 = an even load at top-2


def test_megatron_checkpoint_resumes_at_another_ep(runs, tmp_path, data_cache, model_dir):
    """Saved at EP=2 (megatron's chained dense + expert optimizer), resumed at EP=1 (one optimizer)."""
    full = runs("ep2", *EP2)
    run_dir = tmp_path / "ep1"
    shutil.copytree(full / "checkpoints" / "step_00000002", run_dir / "checkpoints" / "step_00000002")
    train(run_dir, data_cache, *STEPS, f"model.name_or_path={model_dir}", "backend=megatron", "megatron.ep=1")
    [(ckpt, step, loaded)] = resumes(run_dir)
    assert (ckpt, step) == ("step_00000002", 2) and loaded in ("resharded", "converted")
    assert losses(run_dir) == pytest.approx(losses(full)[K:], rel=2e-5)


def _convert_and_resume(tmp_path, data_cache, model_dir, source, to_args, overrides):
    resumed = tmp_path / "resumed"
    run_in_process(["convert", str(source / "checkpoints" / "step_00000002"),
             str(resumed / "checkpoints" / "step_00000002"), *to_args])
    train(resumed, data_cache, *STEPS, f"model.name_or_path={model_dir}", *overrides)
    assert resumes(resumed) == [("step_00000002", K, "as saved")]  # the converted checkpoint, at its layout
    return losses(source), losses(resumed)


def test_zero3_to_megatron_ep2_resume_continues_loss(runs, tmp_path, data_cache, model_dir):
    full, resumed = _convert_and_resume(tmp_path, data_cache, model_dir, runs("zero3", "zero.stage=3"),
                                        ["--to", "megatron", "--ep", "2"], EP2)
    assert resumed[0] == pytest.approx(full[K], rel=1e-5), "step k+1: weights not carried exactly"
    assert resumed[1] == pytest.approx(full[K + 1], rel=1e-4), "step k+2: optimizer state not carried"


def test_megatron_ep2_to_zero3_resume_continues_loss(runs, tmp_path, data_cache, model_dir):
    full, resumed = _convert_and_resume(tmp_path, data_cache, model_dir, runs("ep2", *EP2),
                                        ["--to", "zero", "--dp", "2", "--zero-stage", "3"], ["zero.stage=3"])
    assert resumed[0] == pytest.approx(full[K], rel=1e-5), "step k+1: weights not carried exactly"
    assert resumed[1] == pytest.approx(full[K + 1], rel=1e-4), "step k+2: optimizer state not carried"


def test_conversions_across_ep_sizes_are_exact(runs, tmp_path):
    """EP 2 -> 1 -> 2 through megatron, ZeRO and HF: every tensor and Adam moment equal, logits too."""
    from toolkit.convert import convert
    from toolkit.convert.verify import compare_tensors, verify
    from toolkit.formats.detect import open_source
    src = runs("ep2", *EP2) / "checkpoints" / "step_00000004"
    hops = [("ep1", {"to": "megatron", "ep": 1}), ("zero", {"to": "zero", "dp": 3, "zero_stage": 1}),
            ("ep2", {"to": "megatron", "ep": 2}), ("hf", {"to": "hf"})]
    previous = src
    for name, args in hops:
        convert(previous, tmp_path / name, **args)
        previous = tmp_path / name
    for name in ("ep1", "zero", "ep2"):
        a, b = open_source(src), open_source(tmp_path / name)
        report = compare_tensors(a, b)
        assert report.ok and report.moments == 2 * report.tensors == 2 * 41, (name, report.lines())
    assert verify(src, tmp_path / "hf").ok
    info = json.loads(run_in_process(["inspect", str(tmp_path / "ep2"), "--json"]).stdout)
    assert info["family"] == "mixtral" and info["layout"]["ep"] == 2 and info["optimizer_state"]


@pytest.mark.parametrize("overrides,world,expected", [
    (["megatron.ep=3"], 3, "4 experts do not divide over megatron.ep=3; choose ep in [1, 2, 4]"),
    (["megatron.ep=2"], 3, "world size 3 is not divisible by megatron.tp=1 x ep=2 x pp=1"),
    (["megatron.tp=2"], 2, "needs megatron.sequence_parallel=true"),
])
def test_bad_expert_layouts_are_refused(overrides, world, expected, model_dir):
    import re

    from toolkit.config import ConfigError, load_config
    from toolkit.plan import build_plan
    with pytest.raises(ConfigError, match=re.escape(expected)):
        build_plan(load_config(None, ["backend=megatron", f"model.name_or_path={model_dir}", *overrides]), [world])


def test_alltoall_is_planned_anywhere_but_refused_before_launch_without_gpus(tmp_path, data_cache, model_dir):
    """A GPU job can be planned and estimated on a laptop; launching it on a CPU machine fails before
    any rank starts."""
    from toolkit.config import load_config
    from toolkit.plan import build_plan
    sets = [f"model.name_or_path={model_dir}", "backend=megatron", "megatron.moe_dispatcher=alltoall"]
    assert build_plan(load_config(None, sets), [2]).config.megatron.moe_dispatcher == "alltoall"
    code, out, err = refused(train_args(tmp_path / "r", data_cache, *sets))
    assert code == 2 and "megatron.moe_dispatcher=alltoall needs GPUs" in err and "toolkit: megatron on" not in out


def test_expert_parallelism_on_a_dense_model_is_refused():
    from toolkit.config import ConfigError, load_config
    from toolkit.plan import build_plan
    with pytest.raises(ConfigError, match="megatron.ep=2 needs a mixture-of-experts model; llama has no experts"):
        build_plan(load_config(None, ["backend=megatron", "megatron.ep=2"]), [2])  # the demo's tiny Llama


def test_bad_expert_layout_fails_before_launch(tmp_path, data_cache, model_dir):
    code, out, err = refused(train_args(tmp_path / "r", data_cache, f"model.name_or_path={model_dir}", *EP2, nproc=3))
    assert code == 2 and "world size 3 is not divisible by megatron.tp=1 x ep=2" in err
    assert "toolkit: megatron on" not in out
