"""examples/slurm and examples/kubernetes: the scripts run as written, with stand-ins for Slurm's
srun and scontrol that start the tasks on this machine; the manifest agrees with the CLI."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import REPO, TINY, losses
from toolkit.parallel import free_port

SRUN = r"""#!/bin/bash
# Stand-in for srun: SLURM_NNODES x SLURM_NTASKS_PER_NODE tasks of the command, on this machine.
while [[ $1 == --* ]]; do shift; done
n=$((SLURM_NNODES * SLURM_NTASKS_PER_NODE)); pids=()
for ((i = 0; i < n; i++)); do
  SLURM_PROCID=$i SLURM_NODEID=$((i / SLURM_NTASKS_PER_NODE)) SLURM_LOCALID=$((i % SLURM_NTASKS_PER_NODE)) \
    SLURM_NTASKS=$n "$@" &
  pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
SCONTROL = "#!/bin/bash\necho 127.0.0.1\n"


def _sbatch(script: str, tmp_path: Path, data_cache: Path, tasks_per_node: int, **env) -> subprocess.CompletedProcess:
    """Run an sbatch script as Slurm would on the first node of a 2-node allocation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    config = tmp_path / "config.yaml"
    sets = dict(s.split("=", 1) for s in [*TINY, f"data.cache_dir={data_cache}"])
    raw: dict = {}
    for key, value in sets.items():
        section, field = key.split(".")
        raw.setdefault(section, {})[field] = yaml.safe_load(value)
    config.write_text(yaml.safe_dump(raw))
    slurm = {"SLURM_JOB_NAME": "toolkit-test", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2",
             "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_NTASKS": str(2 * tasks_per_node),
             "SLURM_GPUS_ON_NODE": str(tasks_per_node)}
    full_env = {**os.environ, **slurm, "CONFIG": str(config), "RUN_DIR": str(tmp_path / "run"),
                "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(REPO / "examples/slurm" / script)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)


def _check(proc: subprocess.CompletedProcess, run_dir: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert len(losses(run_dir)) == 6 and (run_dir / "hf_final" / "config.json").is_file()


@pytest.mark.slow
def test_sbatch_one_agent_per_node(tmp_path, data_cache):
    proc = _sbatch("train.sbatch", tmp_path, data_cache, tasks_per_node=1, RDZV_PORT=str(free_port()))
    _check(proc, tmp_path / "run")
    assert "1 rank(s) x 2 node(s)" in proc.stdout


@pytest.mark.slow
def test_sbatch_one_rank_per_task(tmp_path, data_cache):
    proc = _sbatch("train_srun.sbatch", tmp_path, data_cache, tasks_per_node=1, MASTER_PORT=str(free_port()))
    _check(proc, tmp_path / "run")


def test_sbatch_scripts_parse():
    for script in ("train.sbatch", "train_srun.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "examples/slurm" / script)], check=True)


def test_pytorchjob_node_count_and_rank_wiring_agree_with_the_cli():
    job = yaml.safe_load((REPO / "examples/kubernetes/pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(s["replicas"] for s in specs.values())
    for spec in specs.values():
        container = spec["template"]["spec"]["containers"][0]
        script = container["args"][0]
        assert f"--nnodes {pods}" in script and '--node-rank "$RANK"' in script
        assert "--rdzv-endpoint" in script  # what makes toolkit train the pod's agent despite RANK
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert re.search(rf"--nproc {gpus}\b", script)
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/runs", "/dev/shm", "/config"} <= mounts


@pytest.mark.parametrize("env,own_rendezvous,external", [
    ({}, False, False),
    ({"RANK": "1", "WORLD_SIZE": "4"}, False, True),  # deepspeed launcher / plain env:// ranks
    ({"RANK": "1", "WORLD_SIZE": "2"}, True, False),  # a PyTorchJob pod: RANK is the pod's index
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, False, True),  # srun, one task per rank
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, True, False),  # srun, one agent per node
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, False, False),  # a single-task allocation
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, True, True),  # a torchrun rank, whatever its args
])
def test_who_starts_the_ranks(monkeypatch, env, own_rendezvous, external):
    from toolkit.parallel import launched_externally
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launched_externally(own_rendezvous) is external
