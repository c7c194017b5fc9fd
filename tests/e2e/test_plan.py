"""The run plan (toolkit/plan): resolved once before launch, written to RUN_DIR/plan.json, and what
every rank reads. Fast: no process group, no training, except one launch that shows the ranks
run the plan, not the YAML."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers.runs import REPO, TINY, losses
from toolkit.config import ConfigError, load_config
from toolkit.layout import megatron_split_problems
from toolkit.plan import Plan, build_plan, read_plan, write_plan


def test_plan_round_trips_through_plan_json(tmp_path):
    plan = build_plan(load_config(None, ["backend=megatron", "megatron.preset=tp2_sp"]), [2, 4])
    again = read_plan(write_plan(plan, tmp_path))
    assert again == plan and isinstance(again, Plan)
    assert again.layout(4).dp == 2 and again.layout(2).sequence_parallel
    assert again.model.hf_config().to_dict() == plan.model.hf_config().to_dict()
    with pytest.raises(ConfigError, match=r"this job has 8 ranks, but its plan was made for \[2, 4\]"):
        again.layout(8)


def test_presets_make_a_new_config_and_never_change_the_given_one():
    cfg = load_config(None, ["backend=megatron", "megatron.preset=tp2_pp2", "megatron.pp=1"])
    plan = build_plan(cfg, [2])
    assert (cfg.megatron.tp, cfg.megatron.pp) == (1, 1)  # untouched
    assert (plan.config.megatron.tp, plan.config.megatron.pp) == (2, 1)  # the preset, and explicit pp wins
    assert (plan.layout(2).tp, plan.layout(2).dp) == (2, 1)
    with pytest.raises(ConfigError, match=r"megatron.preset='nope' is neither a file nor one of megatron_configs/ \["):
        build_plan(load_config(None, ["backend=megatron", "megatron.preset=nope"]), [2])


def test_every_node_count_of_an_elastic_job_is_checked():
    cfg = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=2"])
    plan = build_plan(cfg, [2, 4])  # 1:2 nodes x 2 ranks
    assert sorted(plan.layouts) == [2, 4] and plan.ds_config(4)["gradient_accumulation_steps"] == 1
    with pytest.raises(ConfigError, match="dp=6"):
        build_plan(cfg, [2, 4, 6])  # 3 nodes x 2 ranks cannot split a global batch of 8


def test_the_split_rules_name_the_valid_choices():
    assert megatron_split_problems(12, 4, 6, 0, tp=3, pp=1, ep=1) == [
        "num_key_value_heads=4 is not divisible by megatron.tp=3; choose tp in [1, 2, 4]"]
    assert megatron_split_problems(12, 12, 6, 8, tp=1, pp=1, ep=3, names={"tp": "--tp", "pp": "--pp", "vpp": "vpp",
                                                                       "ep": "--ep"}) == [
        "8 experts do not divide over --ep=3; choose ep in [1, 2, 4, 8]"]


def test_shipped_presets_are_package_data():
    from toolkit import resources
    assert {"zero0", "zero1", "zero2", "zero3", "zero3_offload"} <= set(resources.presets("deepspeed"))
    assert {"tp2", "pp2", "tp2_pp2", "tp2_sp"} <= set(resources.presets("megatron"))
    for kind, folder in (("deepspeed", "ds_configs"), ("megatron", "megatron_configs")):
        for name, shipped in resources.presets(kind).items():  # the checkout's folders are the same files
            assert (REPO / folder / shipped.name).read_bytes() == shipped.read_bytes()
    assert (REPO / "requirements" / "constraints.txt").read_text() == resources.constraints()


@pytest.mark.slow
def test_ranks_run_the_plan_not_the_yaml(tmp_path, data_cache):
    """The YAML (and RUN_DIR/config.yaml) are changed once plan.json exists, before the ranks have
    started: the run still does what was planned (5 steps at lr 2e-3, not 2 steps at 1e-3)."""
    config, run_dir = tmp_path / "run.yaml", tmp_path / "run"
    config.write_text("train:\n  steps: 5\n  lr: 0.002\n")
    args = [sys.executable, "-m", "toolkit", "train", str(config), "--run-dir", str(run_dir), "--nproc", "1"]
    for s in [t for t in TINY if not t.startswith(("train.steps", "train.lr"))] + [f"data.cache_dir={data_cache}"]:
        args += ["--set", s]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "plan.json").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    changed = "train:\n  steps: 2\n  lr: 0.001\n"
    config.write_text(changed)
    (run_dir / "config.yaml").write_text(changed)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses(run_dir)) == 5
    assert max(r["lr"] for r in rows if "lr" in r) == pytest.approx(2e-3)


def test_nodes_writing_the_plan_together_leave_one_complete_file(tmp_path):
    """Every node's agent writes RUN_DIR/plan.json on a shared filesystem at about the same time
    (examples/slurm/train.sbatch): no writer may fail, and the file is always one whole plan."""
    import multiprocessing as mp
    plan = build_plan(load_config(None, TINY), [2])
    ctx = mp.get_context("fork")
    with ctx.Pool(4) as pool:
        pool.starmap(_write_plan_many, [(plan, tmp_path)] * 4)
    assert read_plan(tmp_path / "plan.json") == plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left behind


def _write_plan_many(plan, run_dir):
    for _ in range(200):
        write_plan(plan, run_dir)


def test_megatron_refuses_a_config_json_without_its_shapes(tmp_path):
    """The megatron model is built from config.json's shapes; a missing one is named, never defaulted."""
    config = {**json.loads((REPO / "toolkit/demo/tiny-llama/config.json").read_text())}
    del config["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json has no num_attention_heads; the megatron model is built"):
        build_plan(load_config(None, ["backend=megatron", f"model.name_or_path={tmp_path}"]), [2])


def test_a_sliding_window_needs_the_toolkits_attention(tmp_path):
    """Phi-3's sliding window runs through the toolkit's core attention; megatron's local one has none."""
    from toolkit.families.tiny import TINY
    (tmp_path / "config.json").write_text(json.dumps(TINY["phi3"]))
    args = ["backend=megatron", f"model.name_or_path={tmp_path}"]
    assert build_plan(load_config(None, args), [2]).model.model_type == "phi3"
    with pytest.raises(ConfigError, match=r"sliding_window=6 needs the toolkit's core attention; .* "
                                          r"set megatron.attention=auto"):
        build_plan(load_config(None, [*args, "megatron.attention=local"]), [2])
