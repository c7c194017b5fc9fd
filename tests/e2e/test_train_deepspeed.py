"""DeepSpeed path end to end: real ranks on gloo through `toolkit train`, against a 1-process reference."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import TINY, losses, refused, resumes, train, train_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(runs):
    """Single process, no ZeRO: micro-batch 2 x 4 accumulation steps = the same global batch of 8."""
    return runs("reference", "zero.stage=0", nproc=1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_at_dp2_matches_single_process(stage, runs, reference):
    ref, got = losses(reference), losses(runs(f"zero{stage}", f"zero.stage={stage}"))
    assert len(got) == len(ref) == 6
    assert got[0] == pytest.approx(ref[0], rel=1e-6), "same weights and data must give the same initial loss"
    assert got == pytest.approx(ref, rel=1e-6)
    assert got[-1] < got[0]


def test_loss_golden_zero2_dp2(runs, request):
    """ZeRO-2 at DP=2 reproduces its recorded curve to the bit (tests/helpers/goldens.py)."""
    from tests.helpers.goldens import check_golden
    check_golden(request, "zero2_dp2", runs("zero2", "zero.stage=2"),
                 [*TINY, "checkpoint.every=3", "zero.stage=2"], nproc=2)


@pytest.mark.parametrize("nproc,micro", [(2, 1), (1, 8), (2, 4)])
def test_loss_contract_micro_batch_accumulation_dp(nproc, micro, runs, reference):
    """Same global batch, different micro-batch x accumulation x DP: same losses (mean over valid tokens)."""
    got = losses(runs(f"contract_{nproc}_{micro}", "zero.stage=2", f"train.micro_batch_size={micro}", nproc=nproc))
    assert got == pytest.approx(losses(reference), rel=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_kill_9_and_resume_is_bitwise_exact(stage, runs, tmp_path, data_cache):
    """At stage 2 the crashed run's ranks are spawned (`python -m toolkit.train.worker`, as with a GPU) and
    the resume is the user's command in a new process, its message read; at stage 3 both runs fork
    their ranks from a forkserver. Either way the same run."""
    uninterrupted = losses(runs(f"zero{stage}", f"zero.stage={stage}"))
    run_dir = tmp_path / "crashed"
    start = {"TOOLKIT_RANK_START": "spawn"} if stage == 2 else {}
    crashed = train(run_dir, data_cache, "checkpoint.every=3", f"zero.stage={stage}",
                    env={"TOOLKIT_FAULT": "kill:step=5:rank=1", **start}, check=False)
    assert crashed.returncode != 0
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").exists()
    assert not (run_dir / "checkpoints" / "step_00000006").exists()
    resumed = train(run_dir, data_cache, "checkpoint.every=3", f"zero.stage={stage}", isolated=stage == 2)
    if stage == 2:
        assert "resumed from step_00000003 at step 3" in resumed.stdout
    assert resumes(run_dir) == [("step_00000003", 3, "as saved")]
    assert losses(run_dir) == uninterrupted  # exact: bit for bit on CPU


def test_checkpoint_is_self_describing_and_loads_in_hf(runs):
    """The HF export loads with from_pretrained and holds, tensor for tensor, what DeepSpeed's own
    zero_to_fp32 reconstructs from the last checkpoint."""
    import json

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM
    run_dir = runs("zero2", "zero.stage=2")
    ckpt = run_dir / "checkpoints" / "step_00000006"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["format"] == "toolkit-deepspeed" and meta["family"] == "llama" and meta["step"] == 6
    assert meta["layout"] == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2}
    assert (ckpt / "engine" / "global_step6").is_dir() and (ckpt / "config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(run_dir / "hf_final", dtype=torch.float32).state_dict()
    reference = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "engine"))
    assert set(reference) <= set(loaded)
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor.float()), name
    assert (run_dir / "ds_config.json").exists() and (run_dir / "config.yaml").exists()


def test_bad_config_fails_before_launch(tmp_path, data_cache):
    code, out, err = refused(train_args(tmp_path / "r", data_cache, "train.micro_batch_size=3"))
    assert code == 2 and "not divisible" in err and "toolkit: deepspeed on" not in out
    code, _, err = refused(train_args(tmp_path / "r", data_cache, "data.text_column=body"))
    assert code == 2 and "body" in err


def test_demo_shortened(tmp_path, data_cache):
    """`toolkit train` with only the length shortened: 2 ranks, ZeRO-2, loss falls, HF export loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run_dir = tmp_path / "demo"
    train(run_dir, data_cache, "train.steps=40", "train.eval_every=20", base=[])
    got = losses(run_dir)
    assert len(got) == 40 and got[-1] < got[0] - 1.0
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf_final")
    tok = AutoTokenizer.from_pretrained(run_dir / "hf_final")
    ids = tok("The function returns", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_activation_checkpointing_changes_nothing(runs, reference):
    got = losses(runs("act_ckpt", "zero.stage=2", "model.activation_checkpointing=true"))
    assert got == pytest.approx(losses(reference), rel=1e-6)


def test_zero3_cpu_offload_matches_reference(runs, reference):
    """Optimizer and parameters offloaded to CPU (DeepSpeedCPUAdam): same trajectory."""
    got = losses(runs("offload", "zero.ds_config=zero3_offload"))
    assert got == pytest.approx(losses(reference), rel=1e-4)


def test_bf16_trains(runs, reference):
    run = runs("bf16", "zero.stage=2", "model.dtype=bf16")
    got = losses(run)
    assert got[0] == pytest.approx(losses(reference)[0], rel=2e-2)  # bf16 rounding of the same model
    assert got[-1] < got[0]
    # the export holds the fp32 master weights, and its config says so: HF loads them as they are
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(run / "hf_final"))
    saved = load_file(str(run / "hf_final" / "model.safetensors"))
    assert model.dtype == torch.float32
    assert all(torch.equal(p, saved[n]) for n, p in model.state_dict().items() if n in saved)


def _launch_externally(launcher: str, toolkit_args: list[str]) -> list:
    """Commands and environments that make `toolkit train` one rank of a job started by another launcher."""
    import os
    import sys

    from toolkit.parallel import free_port
    env, port = {**os.environ, "PYTHONUNBUFFERED": "1"}, str(free_port())
    if launcher == "torchrun":
        return [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "-m", "toolkit", *toolkit_args], env)]
    if launcher == "deepspeed":  # it inserts --local_rank=N after the module name
        return [([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port,
                  "--module", "toolkit", *toolkit_args], env)]
    # srun: one task per rank, SLURM_* variables, MASTER_ADDR/PORT exported by the job script
    return [([sys.executable, "-m", "toolkit", *toolkit_args],
             {**env, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(2)]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "srun"])
def test_external_launchers_match_own_launcher(launcher, runs, tmp_path, data_cache):
    """The same `toolkit train` as one rank of a torchrun, deepspeed-launcher or srun job: same run."""
    import subprocess

    from tests.helpers.runs import REPO, TINY
    run_dir = tmp_path / launcher
    sets = [a for s in [*TINY, f"data.cache_dir={data_cache}", "checkpoint.every=3", "zero.stage=2"]
            for a in ("--set", s)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in _launch_externally(launcher, ["train", "--run-dir", str(run_dir), *sets])]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outputs)
    assert losses(run_dir) == losses(runs("zero2", "zero.stage=2"))


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_export_equals_deepspeeds_zero_to_fp32(stage, runs):
    """Our HF export of the final step vs DeepSpeed's own reconstruction of the same checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    run_dir = runs(f"zero{stage}", f"zero.stage={stage}")
    reference = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints" / "step_00000006" / "engine"))
    exported = load_file(run_dir / "hf_final" / "model.safetensors")
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor.float()), name


@pytest.mark.parametrize("zero", [["zero.stage=2"], ["zero.stage=3", "zero.offload_optimizer=true"]],
                         ids=["zero2", "zero3_offload"])
def test_resume_exact_over_a_long_window(zero, tmp_path, data_cache):
    """Past step 14, DeepSpeed's CPU Adam kernels (FusedAdam on CPU; DeepSpeedCPUAdam under offload)
    drift unless the adapter replays their hidden beta^t state on load (test_cpu_adam_resume.py)."""
    long = ["train.steps=20", "checkpoint.every=4", *zero]
    train(tmp_path / "a", data_cache, *long)
    train(tmp_path / "b", data_cache, *long, "restart.max_restarts=1", "restart.backoff_s=0.2",
          env={"TOOLKIT_FAULT": "kill:step=14:rank=1"})
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    assert resumes(tmp_path / "b") == [("step_00000012", 12, "as saved")]
