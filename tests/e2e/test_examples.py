"""examples/slurm and examples/kubernetes: the scripts run as written, with stand-ins for Slurm's
srun and scontrol that start the tasks on this machine; the Kubeflow Trainer v2 manifests validate
against the Trainer API's published models (kubeflow-trainer-api) and agree with the CLI, and the
TrainJob's command gives `toolkit train` each pod's place from the variables the torch runtime sets."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubeflow_trainer_api import models as trainer_api

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


def _tiny_config(path: Path, data_cache: Path) -> Path:
    """The TINY run as a YAML config file."""
    sets = dict(s.split("=", 1) for s in [*TINY, f"data.cache_dir={data_cache}"])
    raw: dict = {}
    for key, value in sets.items():
        section, field = key.split(".")
        raw.setdefault(section, {})[field] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(raw))
    return path


def _sbatch(script: str, tmp_path: Path, data_cache: Path, tasks_per_node: int, **env) -> subprocess.CompletedProcess:
    """Run an sbatch script as Slurm would on the first node of a 2-node allocation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    config = _tiny_config(tmp_path / "config.yaml", data_cache)
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


KUBE = REPO / "examples/kubernetes"


def _manifest(name: str) -> dict:
    return yaml.safe_load((KUBE / name).read_text())


def api_problems(manifest: dict, model) -> list[str]:
    """Why ``manifest`` is not a valid object of the Trainer API's ``model``: a field of the wrong type
    (the model refuses it), or one the API does not have (the generated models drop unknown keys
    silently, so the manifest must survive a round trip unchanged)."""
    try:
        parsed = model.from_dict(manifest)
    except ValueError as exc:  # pydantic's ValidationError
        return [str(exc)]
    return [f"{path}: {what}" for path, what in _differences(manifest, parsed.to_dict())]


def _differences(given, kept, path: str = "") -> list[tuple[str, str]]:
    if isinstance(given, dict) and isinstance(kept, dict):
        out = [(f"{path}.{k}", "not a field of the API") for k in given if k not in kept]
        return out + [d for k in given if k in kept for d in _differences(given[k], kept[k], f"{path}.{k}")]
    if isinstance(given, list) and isinstance(kept, list) and len(given) == len(kept):
        return [d for i, (g, k) in enumerate(zip(given, kept)) for d in _differences(g, k, f"{path}[{i}]")]
    return [] if given == kept else [(path, f"{given!r} read back as {kept!r}")]


def test_trainjob_and_runtime_validate_against_the_trainer_v2_models():
    runtime, job = _manifest("runtime.yaml"), _manifest("trainjob.yaml")
    assert (runtime["apiVersion"], runtime["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert api_problems(runtime, trainer_api.TrainerV1alpha1TrainingRuntime) == []
    assert api_problems(job, trainer_api.TrainerV1alpha1TrainJob) == []


def test_the_api_check_catches_a_wrong_field_and_a_wrong_type():
    job = _manifest("trainjob.yaml")
    job["spec"]["trainer"]["numProcsPerNode"] = job["spec"]["trainer"].pop("numProcPerNode")  # misspelled
    assert api_problems(job, trainer_api.TrainerV1alpha1TrainJob) == [
        ".spec.trainer.numProcsPerNode: not a field of the API"]
    job = _manifest("trainjob.yaml")
    job["spec"]["trainer"]["numNodes"] = "2"
    assert "numNodes" in api_problems(job, trainer_api.TrainerV1alpha1TrainJob)[0]


def _node_container(runtime: dict) -> tuple[dict, dict]:
    """The runtime's trainer Job spec and its "node" container (where the torch runtime puts PET_*)."""
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    trainer = [j for j in jobs if j["template"]["metadata"]["labels"].get(
        "trainer.kubeflow.org/trainjob-ancestor-step") == "trainer"]
    assert len(trainer) == 1 and trainer[0]["name"] == "node"
    job_spec = trainer[0]["template"]["spec"]
    containers = [c for c in job_spec["template"]["spec"]["containers"] if c["name"] == "node"]
    assert len(containers) == 1
    return job_spec, containers[0]


def test_trainjob_wiring_agrees_with_the_cli_and_the_runtime():
    runtime, job = _manifest("runtime.yaml"), _manifest("trainjob.yaml")
    ref, trainer = job["spec"]["runtimeRef"], job["spec"]["trainer"]
    assert (ref["kind"], ref["name"]) == (runtime["kind"], runtime["metadata"]["name"])
    assert "torch" in runtime["spec"]["mlPolicy"]  # the runtime that sets the PET_* variables
    job_spec, node = _node_container(runtime)
    assert trainer["image"] == node["image"]
    # N nodes x M GPUs: PET_NPROC_PER_NODE is numProcPerNode only when set (else "auto", which
    # --nproc refuses), and must equal the GPUs per pod.
    assert trainer["numNodes"] >= 2 and trainer["numProcPerNode"] == trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]
    script = trainer["args"][0]
    assert trainer["command"] == ["bash", "-c"] and script.lstrip().startswith("exec toolkit train ")
    for flag, var in (("--nproc", "PET_NPROC_PER_NODE"), ("--nnodes", "PET_NNODES"), ("--node-rank", "PET_NODE_RANK"),
                      ("--rdzv-endpoint", "PET_MASTER_ADDR:$PET_MASTER_PORT")):
        assert f'{flag} "${var}"' in script, flag
    # One owner of restarts: the toolkit's supervisor; the controller retries nothing but preemption.
    assert "--max-restarts" in script
    assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 0
    assert job_spec["backoffLimit"] == 0 and job_spec["template"]["spec"]["restartPolicy"] == "Never"
    assert job_spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onExitCodes": {"containerName": "node", "operator": "In", "values": [75]}}]
    from toolkit.watch.protocol import PREEMPTED_EXIT
    assert PREEMPTED_EXIT == 75
    mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
    volumes = {v["name"]: v for v in job_spec["template"]["spec"]["volumes"]}
    assert {"/runs", "/dev/shm", "/config", "/data"} <= set(mounts) and set(mounts.values()) <= set(volumes)
    assert "persistentVolumeClaim" in volumes[mounts["/runs"]] and "--run-dir /runs/" in script
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def _trainjob_command_args(tmp_path: Path, **pet: str) -> list[str]:
    """What `toolkit train` receives from the TrainJob's command in a pod given the torch runtime's
    ``PET_*`` values: the script run by bash with a stand-in `toolkit` that writes its arguments."""
    script = _manifest("trainjob.yaml")["spec"]["trainer"]["args"][0]
    bin_dir, out = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "toolkit").write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {out}\n")
    (bin_dir / "toolkit").chmod(0o755)
    subprocess.run(["bash", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin", **pet}, check=True, timeout=30)
    return out.read_text().splitlines()


def test_trainjob_command_maps_the_torch_runtime_variables_to_the_cli(tmp_path):
    """The pods of a 2-node job with the values the torch runtime injects (node rank from the Job's
    completion index, node 0's DNS name, port 29500): `toolkit train`'s own parser reads them as this
    pod's place in the job, and the pod is an agent that starts its ranks. The launch path those flags
    take is the one examples/slurm/train.sbatch runs for real above (one agent per node, c10d
    rendezvous on node 0). Left "auto" (numProcPerNode unset), --nproc is refused."""
    from toolkit.cli import _parser
    from toolkit.parallel import launched_externally
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_MASTER_ADDR": "toolkit-train-node-0-0.toolkit-train",
           "PET_MASTER_PORT": "29500"}
    for rank in range(2):
        argv = _trainjob_command_args(tmp_path, **pet, PET_NODE_RANK=str(rank))
        args = _parser().parse_args(argv)
        assert (args.command, args.config, args.run_dir) == ("train", "/config/config.yaml", "/runs/toolkit-train")
        assert (args.nproc, args.nnodes, args.min_nnodes, args.node_rank) == (8, 2, 2, rank)
        assert args.rdzv_endpoint == "toolkit-train-node-0-0.toolkit-train:29500" and args.max_restarts == 3
        assert launched_externally(own_rendezvous=args.rdzv_endpoint is not None) is False
    auto = _trainjob_command_args(tmp_path, **{**pet, "PET_NPROC_PER_NODE": "auto"}, PET_NODE_RANK="0")
    with pytest.raises(SystemExit):
        _parser().parse_args(auto)


def test_legacy_pytorchjob_node_count_and_rank_wiring_agree_with_the_cli():
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
