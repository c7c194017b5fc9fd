import json

import pytest

from toolkit.config import ConfigError, load_config
from toolkit.plan import build_plan


def ds_config(cfg, world: int = 2) -> dict:
    """The DeepSpeed JSON the plan resolves for ``world`` ranks (the demo model: hidden 128)."""
    return build_plan(cfg, [world]).ds_config(world)


def test_defaults_are_the_demo():
    cfg = load_config()
    assert cfg.backend == "deepspeed" and cfg.nproc == 2 and cfg.zero.stage == 2
    assert cfg.model.name_or_path.endswith("tiny-llama")


def test_overrides_are_typed():
    cfg = load_config(None, ["train.steps=7", "model.dtype=bf16", "train.lr=1e-4", "train.min_lr=1e-5"])
    assert cfg.train.steps == 7 and cfg.model.dtype == "bf16" and cfg.train.lr == 1e-4


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key train.global_batch; did you mean train.global_batch_size\?"):
        load_config(None, ["train.global_batch=8"])
    with pytest.raises(ConfigError, match=r"unknown config key chekpoint; did you mean checkpoint\?"):
        load_config(None, ["chekpoint.every=3"])


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError, match=r"zero.stage=5"):
        load_config(None, ["zero.stage=5"])
    with pytest.raises(ConfigError, match=r"train.steps=0 must be >= 1"):
        load_config(None, ["train.steps=0"])


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["train.steps"])


def test_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 11\nzero:\n  stage: 3\n")
    cfg = load_config(path, ["train.steps=12"])
    assert cfg.train.steps == 12 and cfg.zero.stage == 3
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_global_batch_divisibility_lists_valid_choices():
    cfg = load_config(None, ["train.global_batch_size=12", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"global_batch_size=12 is not divisible by train.micro_batch_size=4 x dp=2; "
                                          r"choose micro_batch_size in \[1, 2, 3, 6\]"):
        build_plan(cfg, [2])


def test_ds_config_auto_resolution():
    cfg = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=2", "zero.stage=3"])
    ds = ds_config(cfg)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4 and ds["zero_optimization"]["stage"] == 3
    assert ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert ds["zero_optimization"]["reduce_bucket_size"] == 128 * 128  # the demo model's hidden size, squared
    assert ds["bf16"]["enabled"] is False


def test_ds_config_contradiction_names_both(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,
                                "zero_optimization": {"stage": 1}}))
    cfg = load_config(None, [f"zero.ds_config={path}", "train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=8 contradicts train.micro_batch_size=2"):
        ds_config(cfg)


def test_ds_config_values_adopted_when_not_set(tmp_path):
    cfg = load_config(None, ["zero.ds_config=zero3_offload"])
    plan = build_plan(cfg, [2])
    resolved = plan.config
    assert resolved.zero.stage == 3 and resolved.zero.offload_optimizer and resolved.zero.offload_params
    assert plan.ds_config(2)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert plan.layout(2).zero_stage == 3 and plan.layout(2).offload_params
    assert cfg.zero.stage == 2 and not cfg.zero.offload_optimizer  # the plan is a new config, not a changed one


def test_ds_config_scheduler_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"scheduler": {"type": "WarmupLR"}}))
    cfg = load_config(None, [f"zero.ds_config={path}"])
    with pytest.raises(ConfigError, match="owns the LR schedule"):
        ds_config(cfg)


def test_offload_params_needs_stage3():
    cfg = load_config(None, ["zero.stage=2", "zero.offload_params=true"])
    with pytest.raises(ConfigError, match="offload_params needs ZeRO stage 3"):
        ds_config(cfg)


def test_rank_start_method_is_checked(monkeypatch):
    from toolkit.run import _rank_entrypoint
    cfg = load_config()
    monkeypatch.setenv("TOOLKIT_RANK_START", "fork")
    with pytest.raises(ConfigError, match=r"TOOLKIT_RANK_START='fork': choose spawn or forkserver"):
        _rank_entrypoint(cfg)
    monkeypatch.setenv("TOOLKIT_RANK_START", "spawn")
    assert _rank_entrypoint(cfg)[1] == ["-u", "-m", "toolkit.train.worker"]
    monkeypatch.setenv("TOOLKIT_RANK_START", "forkserver")
    entrypoint, _, preload = _rank_entrypoint(cfg)
    assert entrypoint.__name__ == "forked_main" and "deepspeed" in preload


def test_forked_rank_takes_the_launchers_environment_not_the_forkservers(monkeypatch):
    """A forkserver keeps the environment it started with (an earlier launch's fault spec, run dir);
    a rank forked from it runs with this launch's, plus what torch's agent set for the rank."""
    from toolkit.launch.elastic import adopt_launcher_env
    threads = []
    monkeypatch.setattr("torch.set_num_threads", threads.append)
    monkeypatch.setattr("os.environ", {"TOOLKIT_FAULT": "kill:step=1", "TOOLKIT_RUN_DIR": "/old", "PATH": "/bin",
                                       "RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"})
    adopt_launcher_env({"TOOLKIT_RUN_DIR": "/new", "PATH": "/venv/bin:/bin", "OMP_NUM_THREADS": "1"})
    import os
    assert os.environ == {"TOOLKIT_RUN_DIR": "/new", "PATH": "/venv/bin:/bin", "OMP_NUM_THREADS": "1", "RANK": "1",
                          "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"}
    assert threads == [1]  # torch's pool was sized when the forkserver imported it


def test_ranks_take_their_share_of_the_cores(monkeypatch):
    """The deepspeed launcher and srun set no OMP_NUM_THREADS: each rank takes cores / local ranks,
    as torchrun's 1 and the toolkit's launcher do (else losses depend on the launcher)."""
    import os

    import torch

    from toolkit import parallel
    for key in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS",
                "SLURM_NNODES"):
        monkeypatch.delenv(key, raising=False)
    assert parallel.local_world_size() == 1
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher
    assert parallel.local_world_size() == 2
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert parallel.local_world_size() == 4
    threads = torch.get_num_threads()
    try:
        parallel.share_cores()
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 4)) == str(torch.get_num_threads())
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        parallel.share_cores()  # a user's setting wins
        assert os.environ["OMP_NUM_THREADS"] == "7"
    finally:
        torch.set_num_threads(threads)


def test_ds_config_without_precision_or_optimizer_sections_gets_the_runs(tmp_path):
    """DeepSpeed reads a missing "bf16" section as off: bf16 weights would train without fp32
    master weights. Missing sections take the run's dtype and the toolkit's AdamW."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    ds = ds_config(load_config(None, [f"zero.ds_config={path}", "model.dtype=bf16"]))
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 3e-3


def test_ds_config_precision_and_offload_errors_name_the_fix(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}}))
    with pytest.raises(ConfigError, match=r"bf16.enabled=True contradicts model.dtype='fp32'; set model.dtype=bf16"):
        ds_config(load_config(None, [f"zero.ds_config={path}"]))
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    with pytest.raises(ConfigError, match=r"offload_param.device='nvme': the toolkit offloads to the CPU only"):
        ds_config(load_config(None, [f"zero.ds_config={path}"]))


@pytest.mark.parametrize("key", ["hang_timeout_s=-1", "io_bytes_per_s=0", "startup_s=0", "save_timeout_s=-5"])
def test_restart_budgets_refuse_what_would_call_every_rank_hung(key):
    """A negative hang timeout (0 turns the watchdog off) or a zero throughput would make every
    budget negative or infinite: refused before launch, naming the key."""
    with pytest.raises(ConfigError, match=f"restart.{key.split('=')[0]}"):
        load_config(None, [f"restart.{key}"])
