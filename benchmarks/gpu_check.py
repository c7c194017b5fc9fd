"""GPU check: one command on a single-GPU machine that reaches no package registry, a PASS/FAIL verdict.

    python3 benchmarks/gpu_check.py --out $OUT                # the GPU machine, carrying .whl/ (540 s budget)
    python3 benchmarks/gpu_check.py --out $OUT --only tests_more   # the rest of the GPU layer, another time
    python3 benchmarks/gpu_check.py --out OUT --rehearse      # a CPU machine: every phase, tiny shapes

Feasible by construction: the GPU comes as one command of at most 600 s on a machine that starts
cold, so every phase has a hard timeout and, on one GPU, the wheels' install, the phases' timeouts
and the wait for the background FusedAdam build add up to no more than the default budget
(``planned_seconds``, 540 s; ``tests/e2e/test_gpu_check.py`` asserts both), which leaves the command
limit 60 s to stop the last phase (SIGTERM, SIGKILL, the GPU cleared: at most 30 s) and write the
summary. A phase that ends early leaves its time to the ones after it (``phase_timeout``). The
phases, in the order the verdict needs them:

1. environment, preflight (real imports of what was carried: a failed import aborts the run);
2. matmul_peak (bf16 N^3, within 0.3x-1.1x of the GPU's spec sheet), throughput_hf (the baseline:
   plain HF + torch AdamW on a learnable synthetic language, held-out loss before and after);
3. fixed_batch (both backends' step-1 loss on one fixed batch, side by side), throughput_deepspeed,
   throughput_megatron (~1.1B Llama, bf16, sequence 4096: tokens/s, MFU recomputed from wall-clock
   steps and FLOPs counted from the HF config by this file's own formula, peak GPU memory);
4. tests_features (the latest features on the device: DPO, bf16 tiles, activation offload, LoRA,
   packed documents with flex attention), tests_layer (megatron vs HF parity, kernels and compile
   probes, fp16 loss scaling, MoE, doctor): the GPU layer trimmed to what fits; the rest of it is
   ``tests_more``, left out of the default run (``--only tests_more``);
5. multi_rank (with 2 or more GPUs only; else SKIP "not possible on 1 GPU").

It first installs the carried wheels (``.whl/``, ``benchmarks/gpu_wheels.py install``) into
``WORK/site`` and puts that first on every phase's PYTHONPATH (on a CPU with another Python than
3.12 the rehearsal runs ``gpu_wheels.py check`` instead: cp312 wheels do not install there). The
DeepSpeed FusedAdam JIT build starts in the background right after and is joined (at most
``FUSED_ADAM_S`` after its start) before the first phase that trains with DeepSpeed; a failed build
is a PASS with its reason: the toolkit falls back to torch's AdamW by design.

The parent process uses the standard library only. Each phase runs as ``gpu_check.py --phase NAME``
in its own process session (``start_new_session``) under a hard timeout: on timeout the session gets
SIGTERM, then SIGKILL, and so does every process that carries the phase's token in its environment
(ranks that left the session too); the phase then fails if any such process is left, or if
``nvidia-smi --query-compute-apps`` still lists a process on the GPU. A test phase stops its pytest
itself shortly before its timeout and reports the tests that did not finish.

``OUT`` gets three files only, each rewritten after every phase (a run stopped from outside keeps
what it had): ``results.json`` (each phase's status, seconds, peak memory, log tail, and every check
with its measured value beside its bound), ``summary.md`` (the PASS/FAIL table) and ``logs.tar.gz``
(every phase's log). Scratch (installed wheels, runs, models) goes to ``--work``. Exit 0 only when
every check passed (SKIP is allowed only for what one GPU cannot do, e.g. multi-rank layouts).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
TOKEN_ENV = "GPU_CHECK_TOKEN"
IMPORTS = ("deepspeed", "megatron.core", "datasets", "pydantic", "peft", "transformers", "toolkit",
           "toolkit.adapters.deepspeed", "toolkit.adapters.megatron")
COMMAND_LIMIT_S = 600
"""The GPU machine's limit on one command (the device tool)."""
DEFAULT_BUDGET_S = 540
"""No phase starts or runs past this; the rest of COMMAND_LIMIT_S is for stopping the last one."""
WHEELS_S = 40
"""Installing the carried wheels (~20, --no-deps --no-compile) into WORK/site."""
FUSED_ADAM_S = 120
"""DeepSpeed's FusedAdam JIT build (nvcc, ninja: 1-2 minutes), counted from its start after the wheels."""
SPEC_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 tensor-core peaks from the vendor's spec sheets (SXM), by a substring of the device name:
this file's own table, not the toolkit's (``toolkit/estimate/flops.py``)."""
MATMUL_SPEC_RANGE = (0.3, 1.1)
"""A measured bf16 matmul rate outside this share of the spec peak is a wrong measurement or a broken
GPU (an H100 measured 769-798 TFLOP/s at N=8192: 0.78-0.81)."""
MFU_FLOOR = 0.05
"""A ~1.1B model at sequence 4096 in bf16 below 5% of the spec peak is not training on the GPU as it should."""
MFU_AGREEMENT = 0.10
"""The toolkit's logged MFU against this file's (wall-clock steps, its own FLOP count): relative."""

LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
            "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LLAMA_TINY = {**LLAMA_1B, "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}
# The fixed-batch model: the demo's tiny Llama with a wide init, so its logits are far from uniform and
# the loss moves with every weight (at initializer_range 0.02 every model's loss is ~log(vocab)).
FIXED_INIT_RANGE = 0.1
BACKENDS = {"deepspeed": ["backend=deepspeed", "zero.stage=1"], "megatron": ["backend=megatron", "megatron.tp=1"]}


@dataclass
class Shape:
    """What differs between the GPU run and its CPU rehearsal."""
    model: dict
    seq_len: int
    micro_batch: int
    accum: int
    steps: int
    warmup: int
    dtype: str
    fixed_seq: int
    matmul_n: int
    pytest_workers: int
    test_filter: dict = field(default_factory=dict)


# pytest_workers: the GPU layer's tests side by side on one GPU (16 cores; each test one process and
# its ranks, most of them mostly starting Python): the wall time of a test phase is its longest test
GPU = Shape(LLAMA_1B, seq_len=4096, micro_batch=2, accum=2, steps=10, warmup=3, dtype="bf16", fixed_seq=256,
            matmul_n=8192, pytest_workers=12)
REHEARSAL = Shape(LLAMA_TINY, seq_len=64, micro_batch=2, accum=1, steps=4, warmup=1, dtype="fp32", fixed_seq=32,
                  matmul_n=256, pytest_workers=0,
                  test_filter={"tests_features": "dpo or tiled or offload or packed_documents and llama",
                               "tests_layer": "compile_probe or sdpa_trains and causal",
                               "tests_more": "kill_resume and megatron"})  # the harness, not every test


@dataclass
class Phase:
    name: str
    timeout_s: float  # on the GPU
    rehearse_timeout_s: float
    aborts: bool = False  # the phase not finishing, or a critical check failing, stops the run
    trains: bool = False  # trains with DeepSpeed: joins the background FusedAdam build first
    gpus: int = 1  # runs only with this many GPUs (SKIP below)
    default: bool = True  # in a run without --only


PHASES = [
    Phase("environment", 15, 90, aborts=True),
    Phase("preflight", 40, 120, aborts=True),
    Phase("matmul_peak", 15, 60),
    Phase("throughput_hf", 55, 120),
    Phase("fixed_batch", 60, 240, trains=True),
    Phase("throughput_deepspeed", 80, 180, trains=True),
    Phase("throughput_megatron", 75, 180),
    Phase("tests_features", 75, 420),
    Phase("tests_layer", 75, 300),
    Phase("multi_rank", 150, 300, trains=True, gpus=2),
    Phase("tests_more", 480, 600, default=False),
]


def planned_seconds(phases: list[Phase], gpus: int = 1, timeout=lambda p: p.timeout_s) -> float:
    """The most a run of ``phases`` may take on a machine with ``gpus`` GPUs: the wheels' install, the
    timeouts of the phases that run there, and the part of the FusedAdam build's allowance that the
    phases before the first DeepSpeed training do not already cover (the build runs beside them)."""
    running = [p for p in phases if p.gpus <= gpus]
    first = next((i for i, p in enumerate(running) if p.trains), len(running))
    before = sum(timeout(p) for p in running[:first])
    join = max(FUSED_ADAM_S - before, 0) if first < len(running) else 0
    return WHEELS_S + sum(timeout(p) for p in running) + join


def default_phases() -> list[Phase]:
    return [p for p in PHASES if p.default]


def check(name: str, ok: bool | None, measured=None, bound=None, why: str = "", critical: bool = False) -> dict:
    """One row of the verdict: PASS/FAIL (``ok``), or SKIP when ``ok`` is None (``why`` says why).
    ``critical``: when it fails in a phase that ``aborts``, nothing after it can be trusted."""
    status = SKIP if ok is None else PASS if ok else FAIL
    row = {"check": name, "status": status}
    if critical:
        row["critical"] = True
    if measured is not None:
        row["measured"] = measured
    if bound is not None:
        row["bound"] = bound
    if why:
        row["why"] = why
    return row


# ============================================================================ process sessions (parent)

def _proc_ids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a live process, None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


def tagged(token: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``TOKEN_ENV=token``: every descendant of a
    phase, also those that started a session of their own or were re-parented when their parent died."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    for pid in _proc_ids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        st = _stat(pid)
        if st and st[0] != "Z" and needle in env.split(b"\0"):
            found.append(pid)
    return found


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def gpu_apps() -> list[dict] | None:
    """Processes on the GPU (``nvidia-smi --query-compute-apps``), None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    apps = []
    for line in out.strip().splitlines():
        pid, _, mib = (x.strip() for x in line.partition(","))
        if pid.isdigit():
            apps.append({"pid": int(pid), "mib": float(mib) if mib.replace(".", "").isdigit() else None})
    return apps


class Session:
    """A command in its own process session, with a token in its environment that marks every process
    it starts; ``stop`` ends them all."""

    def __init__(self, cmd: list[str], log: Path, env: dict, cwd: Path = REPO):
        self.token = uuid.uuid4().hex
        self.log = log
        self.started = time.monotonic()
        self.peak_rss = self.peak_gpu_mib = 0
        self._file = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env={**env, TOKEN_ENV: self.token}, stdout=self._file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def sample(self, gpu: bool) -> None:
        pids = tagged(self.token)
        self.peak_rss = max(self.peak_rss, _rss_bytes(pids))
        apps = gpu_apps() if gpu else None
        if apps:
            mine = set(pids) | {self.proc.pid}
            self.peak_gpu_mib = max(self.peak_gpu_mib, sum(a["mib"] or 0 for a in apps if a["pid"] in mine))

    def wait(self, timeout: float, gpu: bool = False, every: float = 1.0) -> int | None:
        """The exit code, or None when ``timeout`` passed (the session still runs)."""
        deadline = time.monotonic() + max(timeout, 0)
        while True:
            try:
                return self.proc.wait(timeout=max(min(every, deadline - time.monotonic()), 0.01))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return None
                self.sample(gpu)

    def stop(self, grace: float = 10.0) -> list[int]:
        """SIGTERM to the session's group and every tagged process, SIGKILL after ``grace``; returns the
        pids still alive after that (an empty list when all are gone)."""
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            self._signal(sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self._alive():
                time.sleep(0.1)
            if not self._alive():
                break
        self._file.close()
        return self._alive()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in tagged(self.token):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.poll()  # reap the leader

    def _alive(self) -> list[int]:
        self.proc.poll()
        group = [pid for pid in _proc_ids() if (st := _stat(pid)) and st[1] == self.proc.pid and st[0] != "Z"]
        return sorted(set(group) | set(tagged(self.token)))

    def seconds(self) -> float:
        return round(time.monotonic() - self.started, 1)


# ================================================================================= the run (parent)

class Run:
    def __init__(self, args):
        self.args = args
        self.shape = REHEARSAL if args.rehearse else GPU
        self.out, self.work = args.out.resolve(), args.work.resolve()
        self.logs = self.work / "logs"
        for d in (self.out, self.work, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "mode": "rehearsal (CPU, tiny shapes)" if args.rehearse else "GPU",
                              "command": " ".join(sys.argv), "budget_s": args.budget_s, "phases": {}}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_SKIP_CUDA_CHECK": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if args.rehearse:  # the folder the toolkit's ranks use here: a FusedAdam built before is reused
            sys.path.insert(0, str(REPO))
            from toolkit.compat.torch_extensions import extensions_dir
            self.env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
        else:  # one folder for the background build and every rank after it
            self.env.setdefault("TORCH_EXTENSIONS_DIR", str(self.work / "torch_extensions"))
        self.background: Session | None = None
        self.gpu = shutil.which("nvidia-smi") is not None
        self.phases = self._selected()

    def _selected(self) -> list[Phase]:
        if self.args.only:
            return [p for p in PHASES if p.name in self.args.only]
        return [p for p in PHASES if p.default or (self.args.full and p.name == "tests_more")]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """results.json, summary.md and logs.tar.gz as they stand (after every phase)."""
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "summary.md").write_text(table(self.results) + "\n")
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")

    def record(self, name: str, entry: dict) -> None:
        self.results["phases"][name] = entry
        self.save()
        rows = entry.get("checks", [])
        bad = [r["check"] for r in rows if r["status"] == FAIL]
        print(f"[gpu_check] {name}: {entry['status']} in {entry.get('seconds', 0)} s; "
              f"{len(rows)} checks, failed: {bad or '-'}{'; ' + entry['why'] if entry.get('why') else ''}",
              flush=True)

    # --- set-up at t=0 ---------------------------------------------------------------------------

    def install_wheels(self) -> None:
        """Install the carried wheels into ``--site`` (a folder of its own, first on PYTHONPATH)."""
        wheels = Path(self.args.wheels)
        site = self.work / "site"
        started = time.monotonic()
        if not any(wheels.glob("*.whl")):
            why = f"no wheels in {wheels}: running on this machine's own packages"
            self.record("wheels", {"status": "ok", "why": why, "seconds": 0,
                                   "checks": [check("wheels installed", None if self.args.rehearse else False,
                                                    why=why)]})
            return
        cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_wheels.py"), "--dir", str(wheels), "install",
               str(site), "--without", "transformers,peft" if self.args.machine_transformers else ""]
        if self.args.rehearse and sys.version_info[:2] != (3, 12) and any(wheels.glob("*cp312*.whl")):
            # cp312 wheels do not install here: rehearse their offline resolution for 3.12 instead
            cmd, site = [sys.executable, str(REPO / "benchmarks" / "gpu_wheels.py"), "--dir", str(wheels), "check"], None
        limit = WHEELS_S * (6 if self.args.rehearse else 1)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=self.env, timeout=limit)
            code, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, text = None, f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {limit} s"
        (self.logs / "wheels.log").write_text(text)
        ok = code == 0
        if ok and site is not None:
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), self.env["PYTHONPATH"]])
        self.record("wheels", {"status": "ok" if ok else "error", "seconds": round(time.monotonic() - started, 1),
                               "log_tail": text[-2000:],
                               "checks": [check("wheels installed offline" if site else
                                                "wheels resolve offline for CPython 3.12 (gpu_wheels.py check)",
                                                ok, measured=len(list(wheels.glob('*.whl'))),
                                                why="" if ok else "pip install --no-index failed (log_tail)")]})

    def start_fused_adam(self) -> None:
        """DeepSpeed's FusedAdam JIT build (1-2 minutes with nvcc), in the background from t=0."""
        code = ("import time; t = time.time()\n"
                "from deepspeed.accelerator import get_accelerator\n"
                "b = get_accelerator().create_op_builder('FusedAdamBuilder')\n"
                "assert b is not None, 'this accelerator has no FusedAdamBuilder'\n"
                "b.load(); print(f'FUSED_ADAM_OK {time.time() - t:.1f} s', flush=True)\n")
        if self.args.fused_adam_cmd:  # tests: a stand-in command
            cmd = ["bash", "-c", self.args.fused_adam_cmd]
        else:
            cmd = [sys.executable, "-c", code]
        self.background = Session(cmd, self.logs / "fused_adam.log", self.env)

    def join_fused_adam(self) -> None:
        """Wait for the build until ``FUSED_ADAM_S`` after its start. Built or not, a PASS with what
        happened: without the kernel the toolkit's DeepSpeed runs take torch's AdamW (their
        ``optimizer`` event in metrics.jsonl, checked by the throughput phase, says which ran)."""
        if self.background is None or "fused_adam" in self.results["phases"]:
            return
        s = self.background
        allowance = FUSED_ADAM_S * (3 if self.args.rehearse else 1)
        code = s.wait(max(min(allowance - (time.monotonic() - s.started), self.left() - 30), 1))
        left = s.stop() if code is None else s.stop(grace=2)
        if code is None:
            self._drop_build_locks()
        text = s.log.read_text(errors="replace")
        built = code == 0 and "FUSED_ADAM_OK" in text
        why = ("built" if built else "not built (" + ("stopped after its allowance" if code is None else f"exit {code}")
               + "): DeepSpeed runs fall back to torch's AdamW (their optimizer event says so); log_tail says why")
        self.record("fused_adam", {"status": "ok", "seconds": s.seconds(), "left_behind": left,
                                   "log_tail": text[-2000:],
                                   "checks": [check("DeepSpeed FusedAdam: JIT-built, or the fallback to torch AdamW",
                                                    not left, measured=s.seconds(), bound=allowance, why=why)]})

    def _drop_build_locks(self) -> None:
        """A build stopped mid-way leaves torch's extension lock file: every later load would wait on it."""
        for lock in Path(self.env["TORCH_EXTENSIONS_DIR"]).glob("*/lock"):
            lock.unlink(missing_ok=True)

    # --- phases ------------------------------------------------------------------------------------

    def phase_timeout(self, phase: Phase) -> float:
        """The phase's own timeout; a test phase (the GPU layer, trimmed to fit) also takes what the
        phases before it left unused: it may run to where the plan ends it (``planned_seconds`` of the
        phases up to it). Never past the budget, less 10 s to stop it."""
        timeout = self._nominal(phase)
        if phase.name.startswith("tests_") and not self.args.rehearse:
            upto = self.phases[:self.phases.index(phase) + 1]
            planned = planned_seconds(upto, self._gpus(), timeout=self._nominal)
            timeout = max(timeout, self.started + planned - time.monotonic())
        return max(min(timeout * self.args.timeout_scale, self.left() - 10), 1)

    def _nominal(self, phase: Phase) -> float:
        timeout = phase.rehearse_timeout_s if self.args.rehearse else phase.timeout_s
        return float(dict(t.split("=") for t in self.args.timeouts).get(phase.name, timeout))

    def _gpus(self) -> int:
        return 2 if self.args.rehearse else int(self.results["phases"].get("environment", {}).get("info", {})
                                                .get("device_count") or 1)

    def run_phase(self, phase: Phase) -> dict:
        if self.left() < 15:
            return {"status": "not run", "why": f"no time left ({self.left():.0f} s of the budget)"}
        timeout = self.phase_timeout(phase)
        result_file = self.work / f"phase_{phase.name}.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase.name, "--out", str(self.out),
               "--work", str(self.work), "--phase-timeout-s", str(round(timeout, 1))]
        cmd += ["--rehearse"] if self.args.rehearse else []
        if phase.name in self.args.inject_hang:
            cmd = [sys.executable, "-c", HANG]
        s = Session(cmd, self.logs / f"{phase.name}.log", self.env)
        code = s.wait(timeout, gpu=self.gpu)
        strays = s._alive() if code is not None else []  # what a finished phase left running (ranks, say)
        left = s.stop() if code is None else s.stop(grace=2)  # ended here, strays too
        entry = {"seconds": s.seconds(), "exit": code, "timeout_s": round(timeout),
                 "peak_rss_mib": round(s.peak_rss / 2**20), "left_behind": left}
        if strays:
            entry["strays_ended"] = strays
        if self.gpu:
            entry["peak_gpu_mib"] = s.peak_gpu_mib
        if code is None:
            entry.update(status="timeout", why=f"killed after {timeout:.0f} s (SIGTERM, then SIGKILL to its session)")
        elif code == 0 and result_file.exists():
            entry.update(status="ok", **json.loads(result_file.read_text()))
        else:
            entry.update(status="error", why=f"exit {code}" + ("" if result_file.exists() else ", no result written"))
        if entry["status"] != "ok" or left:
            entry["log_tail"] = s.log.read_text(errors="replace")[-3000:]
        if left:
            entry["status"], entry["why"] = "error", f"processes left after the phase: {left}"
        gpu_left = self.gpu_clear()
        if gpu_left:
            entry["status"], entry["why"] = "error", f"still on the GPU after the phase: {gpu_left}"
        return entry

    def gpu_clear(self) -> list[dict]:
        """Compute processes still on the GPU, after up to 15 s (the driver frees a context late); the
        background FusedAdam build's (it may query the device for its arch flags) are not counted."""
        apps: list[dict] = []
        for _ in range(max(int(self.args.gpu_clear_wait_s), 1)):
            building = set(tagged(self.background.token)) if self.background and self.background.proc.poll() is None \
                else set()
            apps = [a for a in gpu_apps() or [] if a["pid"] not in building]
            if not apps:
                return []
            time.sleep(1)
        return apps

    def go(self) -> int:
        self.install_wheels()
        if not self.args.no_fused_adam:
            self.start_fused_adam()
        aborted = None
        for phase in self.phases:
            if aborted:
                self.record(phase.name, {"status": "not run", "why": f"aborted: {aborted}"})
                continue
            if phase.gpus > self._gpus():
                self.record(phase.name, {"status": "ok", "seconds": 0, "checks": [
                    check(phase.name, None, why=f"not possible on {self._gpus()} GPU: two NCCL ranks cannot "
                                                "share one GPU")]})
                continue
            if phase.trains:
                self.join_fused_adam()
            entry = self.run_phase(phase)
            self.record(phase.name, entry)
            critical = [r["check"] for r in entry.get("checks", []) if r["status"] == FAIL and r.get("critical")]
            if phase.aborts and (entry["status"] != "ok" or critical):
                aborted = f"{phase.name} failed ({entry.get('why') or ', '.join(critical)})"
        if self.background is not None and "fused_adam" not in self.results["phases"]:
            self.join_fused_adam()
        self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self.results["verdict"] = verdict(self.results)
        self.save()
        print(table(self.results), flush=True)
        return 0 if self.results["verdict"] == PASS else 1


HANG = ("import os, subprocess, sys, time, signal\n"  # --inject-hang: a phase that never ends, with a child
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # that ignores SIGTERM and left the session
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); time.sleep(3600)'], start_new_session=True)\n"
        "print('hanging', flush=True); time.sleep(3600)\n")


def verdict(results: dict) -> str:
    """PASS when every phase ran to its end and no check failed; SKIP rows do not fail the run."""
    for entry in results["phases"].values():
        if entry["status"] != "ok" or any(r["status"] == FAIL for r in entry.get("checks", [])):
            return FAIL
    return PASS


def _fmt(value, width: int = 90) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_fmt(v, 30)}" for k, v in value.items())[:width]
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, 20) for v in value)[:width] + "]"
    return str(value)[:width]


def table(results: dict) -> str:
    lines = [f"# GPU check: {results.get('verdict') or 'running (the phases so far)'} ({results['mode']})", "",
             "| phase | check | status | measured | bound | why |", "|---|---|---|---|---|---|"]
    for name, entry in results["phases"].items():
        if entry["status"] != "ok":
            lines.append(f"| {name} | (phase) | {FAIL if entry['status'] != 'ok' else PASS} | "
                         f"{entry['status']} | | {entry.get('why', '')} |")
        for r in entry.get("checks", []):
            cells = [name, r["check"], r["status"], _fmt(r.get("measured")), _fmt(r.get("bound")), r.get("why", "")]
            lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    env = (results["phases"].get("environment") or {}).get("info", {})
    if env:
        lines.append(f"\n{env.get('gpu')} x{env.get('device_count')}, torch {env.get('torch')}, transformers "
                     f"{env.get('transformers')}, peft {env.get('peft')}, CUDA {env.get('cuda')}, "
                     f"Python {env.get('python')} (the machine's versions, not requirements/constraints.txt)")
    for name in ("throughput_hf", "throughput_deepspeed", "throughput_megatron"):
        entry = results["phases"].get(name) or {}
        info = entry.get("info")
        if info:
            memory = info.get("peak_gpu_mib") or entry.get("peak_gpu_mib")
            lines.append(f"{name}: {info.get('tokens_per_s')} tokens/s, MFU {info.get('mfu_spec')} of the spec "
                         f"peak, {info.get('mfu_measured')} of the measured matmul peak, peak GPU memory "
                         f"{memory} MiB (torch's peak allocation where known, else nvidia-smi's), peak host "
                         f"RSS {entry.get('peak_rss_mib')} MiB")
    return "\n".join(lines)


# ======================================================================= phases (each in its own process)

class Ctx:
    def __init__(self, args):
        self.args, self.rehearse = args, args.rehearse
        self.shape = REHEARSAL if args.rehearse else GPU
        self.work, self.out = args.work, args.out
        self.checks: list[dict] = []
        self.info: dict = {}
        self.deadline = time.monotonic() + (args.phase_timeout_s or 3600)

    def add(self, *a, **k) -> dict:
        row = check(*a, **k)
        self.checks.append(row)
        return row

    def device(self) -> str:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def left(self) -> float:
        """Seconds until the parent stops this phase."""
        return self.deadline - time.monotonic()

    def cmd(self, argv: list[str], log: str, env: dict | None = None) -> tuple[int, str]:
        """A command inside the phase (its session is the phase's); its output in WORK/logs/log."""
        path = self.work / "logs" / log
        with open(path, "w") as f:
            code = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=max(self.left(), 1)).returncode
        return code, path.read_text(errors="replace")


def phase_environment(ctx: Ctx) -> None:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device_count": torch.cuda.device_count(), "disk_free_gib": round(shutil.disk_usage(ctx.work).free / 2**30, 1),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for name in ("transformers", "peft"):
        try:
            mod = __import__(name)
            info[name], info[f"{name}_from"] = mod.__version__, str(Path(mod.__file__).parent)
        except ImportError as exc:
            info[name] = f"missing: {exc}"
    ctx.info.update(info)
    ctx.add("CUDA device visible to torch", None if ctx.rehearse else torch.cuda.is_available(),
            measured=info["gpu"], why="rehearsal on the CPU" if ctx.rehearse else "", critical=True)


def phase_preflight(ctx: Ctx) -> None:
    """Real imports of what was carried and of the toolkit's backends: nothing after a failed one can
    be trusted. (Compiles are probed by tests/gpu/test_compile_gpu.py: slow, never a reason to stop.)"""
    import importlib
    import traceback
    for name in IMPORTS:
        try:
            mod = importlib.import_module(name)
            top = sys.modules[name.split(".")[0]]
            version = getattr(mod, "__version__", None) or getattr(top, "__version__", None)
            ctx.add(f"import {name}", True, measured=version, why=str(Path(mod.__file__).parent), critical=True)
        except Exception as exc:  # noqa: BLE001 - any import error is the finding
            ctx.add(f"import {name}", False, why=f"{type(exc).__name__}: {exc}"[:300], critical=True)
            (ctx.work / "logs" / f"import_{name}.txt").write_text(traceback.format_exc())


# --- training runs --------------------------------------------------------------------------------

def train_cmd(run_dir: Path, *sets: str) -> list[str]:
    cmd = [sys.executable, "-m", "toolkit", "train", "--nproc", "1", "--run-dir", str(run_dir), "--resume", "never"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def step_rows(run_dir: Path) -> list[dict]:
    return [r for r in metric_rows(run_dir) if "loss" in r and "tokens_per_s" in r]


NOTABLE = ("optim", "adam", "sync", "kernel", "attention", "compile", "fallback", "fused")


def notable_fields(run_dir: Path) -> dict:
    """What the run recorded about its optimizer (a FusedAdam fallback), host syncs, kernels or compile
    fallbacks, read generically from metrics.jsonl (the last value of each such key; events too), so
    the check needs no change when such fields are added."""
    found = {}
    for r in metric_rows(run_dir):
        found.update({k: v for k, v in r.items() if any(word in k.lower() for word in NOTABLE)})
        if "event" in r and any(word in json.dumps(r).lower() for word in NOTABLE):
            found[f"event:{r['event']}"] = {k: v for k, v in r.items() if k not in ("event", "time")}
    return found


def optimizer_check(ctx: "Ctx", fields: dict, backend: str) -> None:
    """Which Adam ran: the DeepSpeed path records it once (``{"event": "optimizer", "optimizer":
    "FusedAdam" | "torch.optim.AdamW(fused=True)" ..., "fallback_reason": ...}``): a built kernel or
    torch's AdamW after a failed build both PASS (the reason is shown); no record FAILs. megatron's
    distributed optimizer has no such record (its Adam is megatron's own)."""
    record = fields.get("event:optimizer")
    if backend != "deepspeed":
        ctx.add(f"{backend}: optimizer record", None, why="megatron's distributed optimizer: no choice to record")
        return
    ran = record.get("optimizer") if record else None
    ctx.add(f"{backend}: metrics.jsonl names the Adam that ran (FusedAdam, or torch AdamW after a failed build)",
            ran is not None, measured=ran, why=(record or {}).get("fallback_reason") or
            ("" if record else "no optimizer event in metrics.jsonl"))


def host_sync_check(ctx: "Ctx", rows: list[dict], backend: str) -> None:
    """Strict-mode runs record ``host_syncs`` per step: a number that must not grow with the step
    (the CPU suite bounds it per layer count and micro-batches; here it must at least stay flat)."""
    counts = [r["host_syncs"] for r in rows if isinstance(r.get("host_syncs"), int)]
    if not counts:
        ctx.add(f"{backend}: host syncs per step stay flat", None, why="no host_syncs (strict mode off in this run)")
        return
    steady = counts[1:] or counts
    ctx.add(f"{backend}: host syncs per step stay flat", max(steady) == min(steady), measured=max(steady),
            bound=min(steady))


def save_fixed_model(path: Path, perturb: float = 0.0, init_range: float = FIXED_INIT_RANGE) -> None:
    """The demo's tiny Llama, seed 0, initializer_range ``init_range``; ``perturb``: layer 1's attention
    output projection scaled by (1 + perturb), -1 switching that layer's attention off (a stand-in for
    one backend computing something else)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config import DEMO_DIR
    config = AutoConfig.from_pretrained(DEMO_DIR / "tiny-llama")
    config.initializer_range = init_range
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if perturb:
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.weight.mul_(1 + perturb)
    model.save_pretrained(path)


def fixed_batch_losses(work: Path, seq: int, perturb: dict[str, float] | None = None,
                       init_range: float = FIXED_INIT_RANGE, timeout: float = 900) -> dict:
    """Step-1 loss of each backend (one rank, fp32, TF32 off, the same seed: the same first batch, before
    any update) on the fixed model, both backends' runs side by side; ``perturb``: backend -> scale of
    its copy's perturbation; ``init_range`` 0.02 (HF's default) gives the near-uniform logits of the old
    step-1 check."""
    perturb = perturb or {}
    runs, started = {}, time.monotonic()
    for name, sets in BACKENDS.items():
        tag = f"{perturb.get(name, 0.0)}_{init_range}"
        model = work / f"fixed_model_{tag}"
        if not model.exists():
            save_fixed_model(model, perturb.get(name, 0.0), init_range)
        run = work / f"fixed_{name}_{tag}"
        shutil.rmtree(run, ignore_errors=True)
        sets = [f"model.name_or_path={model}", "model.init=pretrained", "model.dtype=fp32", "model.tf32=false",
                f"data.seq_len={seq}", "train.steps=1", "train.global_batch_size=8", "train.micro_batch_size=4",
                "train.eval_every=0", "train.log_every=1", "checkpoint.every=100", "train.export_hf=false",
                f"data.cache_dir={work / 'data_cache' / name}", *sets]
        log = open(work / "logs" / f"{run.name}.log", "w")
        runs[name] = (run, subprocess.Popen(train_cmd(run, *sets), cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log)
    out = {}
    for name, (run, proc, log) in runs.items():
        try:
            code = proc.wait(timeout=max(timeout - (time.monotonic() - started), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
        rows = step_rows(run)
        out[name] = rows[0]["loss"] if code == 0 and rows else None
        out[f"{name}_exit"] = code
    return out


def fixed_batch_checks(losses: dict, vocab: int, bound: float) -> list[dict]:
    """Both backends' step-1 loss finite, the logits far from uniform (else the loss cannot see what the
    attention or the weights do), and the two within ``bound`` of each other (relative)."""
    a, b = losses.get("deepspeed"), losses.get("megatron")
    rows = [check(f"{n} step-1 loss finite", v is not None and math.isfinite(v), measured=v,
                  why="" if v is not None else f"run failed (exit {losses.get(n + '_exit')})")
            for n, v in (("deepspeed", a), ("megatron", b))]
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        rows.append(check("both backends' loss on one fixed batch", False, why="a backend has no finite loss"))
        return rows
    uniform = math.log(vocab)
    distance = abs(a - uniform) / uniform
    rows.append(check("logits far from uniform: |loss - ln V| / ln V", distance >= UNIFORM_DISTANCE, measured=distance,
                      bound=UNIFORM_DISTANCE))
    rel = abs(a - b) / abs(b)
    rows.append(check("both backends' loss on one fixed batch (rel)", rel <= bound, measured=rel, bound=bound))
    return rows


# fp32 without TF32 on both sides: reduction order only (CPU: 0 at seq 32, 8e-8 at 0.25). Switching layer 1's
# attention off in megatron's copy moved its step-1 loss 1.6e-3 at initializer_range 0.1 (CPU,
# tests/e2e/test_gpu_check.py); at HF's 0.02 it moved 3.0e-4, inside the old step-1 check's 2%.
FIXED_BOUND = 2e-5
UNIFORM_DISTANCE = 0.05  # |loss - ln V| / ln V: 0.003 at initializer_range 0.02, 0.09 at 0.1


def phase_fixed_batch(ctx: Ctx) -> None:
    losses = fixed_batch_losses(ctx.work, ctx.shape.fixed_seq, timeout=ctx.left() - 5)
    ctx.info["losses"] = losses
    ctx.checks += fixed_batch_checks(losses, vocab=2048, bound=FIXED_BOUND)


# --- the GPU test layer ---------------------------------------------------------------------------

LAYER = ("megatron_logits and (llama or gemma2) or megatron_bf16 and llama or fp16 or moe or doctor or "
         "flex_trains or sdpa_trains or fusions or compile_probe")
"""tests_layer's share of tests/gpu (-k): what fits its time; tests_more has the rest."""
TEST_SETS = {  # phase -> (files, -k expression); the rehearsal's expressions: REHEARSAL.test_filter
    "tests_features": (["tests/gpu/test_features_gpu.py", "tests/gpu/test_offload_activations_gpu.py",
                        "tests/gpu/test_packing_gpu.py"], ""),
    "tests_layer": (["tests/gpu/test_gpu.py", "tests/gpu/test_attention_gpu.py", "tests/gpu/test_compile_gpu.py"],
                    LAYER),
    "tests_more": (["tests/gpu/test_gpu.py", "tests/gpu/test_qlora_gpu.py", "tests/gpu/test_experts_gpu.py",
                    "tests/gpu/test_vlm_gpu.py"], f"not ({LAYER})"),
}
TEST_STOP_S = 8
"""A test phase stops its pytest this long before the parent would stop the phase, to report the rest."""


def phase_tests(ctx: Ctx, name: str) -> None:
    """``pytest -m gpu`` on one part of tests/gpu, in a session of its own, stopped ``TEST_STOP_S``
    before the phase's end; one check per test from the results the GPU layer streams
    (tests/gpu/conftest.py), every value a test measured (tests/helpers/measure.py) beside its bound,
    and a FAIL for each test that did not finish in time."""
    results, measured = ctx.work / f"{name}_results.jsonl", ctx.work / f"{name}_measured.jsonl"
    for f in (results, measured):
        f.unlink(missing_ok=True)
    files, expression = TEST_SETS[name]
    expression = ctx.shape.test_filter.get(name, expression)
    args = [*files, *(["-k", expression] if expression else [])]
    workers = ["-n", str(ctx.shape.pytest_workers)] if ctx.shape.pytest_workers else []
    env = {**os.environ, "TOOLKIT_GPU_MEASURED": str(measured), "TOOLKIT_GPU_RESULTS": str(results)}
    if ctx.rehearse:
        env["TOOLKIT_GPU_TESTS_ON_CPU"] = "1"
    code = _run_stopped([sys.executable, "-m", "pytest", "-m", "gpu", *args, *workers, "-p", "no:cacheprovider",
                         "-q", "-rA"], ctx.work / "logs" / f"{name}_pytest.log", env, ctx.left() - TEST_STOP_S)
    ctx.info["pytest_exit"] = code
    log = (ctx.work / "logs" / f"{name}_pytest.log").read_text(errors="replace")
    collected, outcomes = read_test_results(results)
    values = [json.loads(x) for x in measured.read_text().splitlines()] if measured.exists() else []
    ctx.checks += test_rows(collected, outcomes, values, stopped=code is None,
                            rerun=f"--only {name}" if name != "tests_more" else "")
    if not collected:
        ctx.add("pytest collected tests", False, measured=code, why=log[-300:])
    elif code not in (0, 1, None):  # 1: some test failed (rows above); None: stopped; else pytest itself broke
        ctx.add("pytest ran", False, measured=code, why=log[-300:])


def _run_stopped(argv: list[str], log: Path, env: dict, seconds: float) -> int | None:
    """``argv`` in a process group of its own; its exit code, or None when it was stopped after
    ``seconds`` (the group gets SIGTERM, then SIGKILL)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 2)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None


def read_test_results(path: Path) -> tuple[list[str], dict[str, dict]]:
    """(every test collected, in order; the outcome of each test that has one) from the stream of
    tests/gpu/conftest.py, where xdist's controller and workers may each write a line: a failure in
    any phase of a test wins over its call passing."""
    collected, outcomes = [], {}
    lines = path.read_text().splitlines() if path.exists() else []
    for record in map(json.loads, lines):
        if "collected" in record:
            collected += [n for n in record["collected"] if n not in collected]
            continue
        known = outcomes.get(record["test"])
        if known is None or known["outcome"] == "passed" and record["outcome"] != "passed":
            outcomes[record["test"]] = record
    return collected, outcomes


def test_rows(collected: list[str], outcomes: dict[str, dict], values: list[dict], stopped: bool,
              rerun: str = "") -> list[dict]:
    """One check per test collected: PASS/FAIL/SKIP with what it measured beside its bounds; a test
    with no outcome FAILs as not finished (the phase stopped it), or as never reported."""
    by_test: dict[str, list] = {}
    for v in values:
        by_test.setdefault(v["test"], []).append(v)
    rows = []
    for node in collected:
        name = node.rsplit("/", 1)[-1]
        short = node.split("::")[-1]
        numbers = {v["name"]: v["measured"] for v in by_test.get(short, [])} or None
        bounds = {v["name"]: v["bound"] for v in by_test.get(short, []) if v.get("bound") is not None} or None
        outcome = outcomes.get(node)
        if outcome is None:
            why = "did not finish before the phase's time ran out" + (f" (rerun: {rerun})" if rerun else "") \
                if stopped else "no outcome reported"
            rows.append(check(name, False, measured=numbers, bound=bounds, why=why))
        elif outcome["outcome"] == "skipped":
            rows.append(check(name, None, why=str(outcome["message"])[:200]))
        else:
            ok = outcome["outcome"] == "passed"
            rows.append(check(name, ok, measured=numbers, bound=bounds,
                              why="" if ok else f"{outcome['when']}: " + _last_lines(outcome["message"])))
    return rows


def _last_lines(text: str, width: int = 300) -> str:
    """The end of a failure report, where the assertion and its error are."""
    lines = [x for x in str(text).splitlines() if x.strip()]
    return " / ".join(lines[-3:])[-width:]


# --- throughput -----------------------------------------------------------------------------------

def llama_flops_per_token(config: dict, seq: int) -> float:
    """Model FLOPs per trained token of a Llama-shaped HF config, counted here from the config (not by
    the toolkit's ``estimate/flops.py``): 6 x the weights every token multiplies (attention q, k, v, o;
    the gated MLP; the norms; the lm_head; not the input embedding, a lookup) + 12 x layers x attention
    width x sequence (PaLM, appendix B)."""
    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    attention = h * heads * head_dim + 2 * h * kv + heads * head_dim * h
    per_layer = attention + 3 * h * inter + 2 * h
    weights = layers * per_layer + h + config["vocab_size"] * h
    return 6 * weights + 12 * layers * heads * head_dim * seq


def spec_peak_flops(device_name: str | None) -> float | None:
    """The bf16 dense peak of ``device_name`` from ``SPEC_BF16_TFLOPS``, None where unknown (a CPU)."""
    if not device_name:
        return None
    return next((v * 1e12 for k, v in SPEC_BF16_TFLOPS.items() if k in device_name), None)


def matmul_checks(tflops: float, device_name: str | None) -> list[dict]:
    """The measured bf16 matmul rate within ``MATMUL_SPEC_RANGE`` of the device's spec sheet."""
    spec = spec_peak_flops(device_name)
    if spec is None:
        return [check("bf16 matmul peak within 0.3x-1.1x of the spec sheet", None, measured=tflops,
                      why=f"no spec peak for {device_name or 'the CPU'} (SPEC_BF16_TFLOPS)")]
    share = tflops * 1e12 / spec
    low, high = MATMUL_SPEC_RANGE
    return [check(f"bf16 matmul peak / spec sheet ({spec / 1e12:.0f} TFLOP/s)", low <= share <= high,
                  measured=round(share, 3), bound=list(MATMUL_SPEC_RANGE), why=f"{tflops:.0f} TFLOP/s measured")]


def phase_matmul_peak(ctx: Ctx) -> None:
    """bf16 (fp32 on the CPU rehearsal) N^3 matmul: FLOP/s on random data, 10 after 3 warm-ups."""
    import torch
    dev, n = ctx.device(), ctx.shape.matmul_n
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    flops = 2 * n ** 3 * 10 / (time.perf_counter() - t)
    name = torch.cuda.get_device_name() if dev == "cuda" else None
    ctx.info.update(tflops=round(flops / 1e12, 1), n=n, dtype=str(dtype), device=name)
    (ctx.work / "matmul_peak.json").write_text(json.dumps({"flops": flops, "device": name}))
    ctx.checks += matmul_checks(flops / 1e12, name)


def mfu_checks(tokens_per_s: float, flops_per_token: float, device_name: str | None, measured_peak: float | None,
               logged_mfu: float | None = None) -> tuple[dict, list[dict]]:
    """MFU from independently measured quantities (tokens/s from wall-clock steps, FLOPs counted from
    the HF config by ``llama_flops_per_token``) against the spec peak and the matmul peak measured
    minutes before; and the toolkit's logged MFU against it (``logged_mfu``, None for the HF baseline)."""
    spec = spec_peak_flops(device_name)
    mfu = tokens_per_s * flops_per_token / spec if spec else None
    of_measured = tokens_per_s * flops_per_token / measured_peak if measured_peak else None
    info = {"mfu_spec": round(mfu, 4) if mfu is not None else None,
            "mfu_measured": round(of_measured, 4) if of_measured is not None else None}
    if mfu is None:
        return info, [check("MFU (wall-clock steps, FLOPs from the HF config) in range", None, measured=of_measured,
                            why=f"no spec peak for {device_name or 'the CPU'}: nothing to compare on a rehearsal")]
    rows = [check("MFU of the spec peak (wall-clock steps, FLOPs from the HF config)", MFU_FLOOR <= mfu <= 1.0,
                  measured=info["mfu_spec"], bound=[MFU_FLOOR, 1.0]),
            check("achieved FLOP/s <= the matmul peak measured here", of_measured is None or of_measured <= 1.0,
                  measured=info["mfu_measured"], bound=1.0,
                  why="" if of_measured is not None else "no matmul_peak result")]
    if logged_mfu is not None:
        gap = abs(logged_mfu - mfu) / mfu
        rows.append(check("the toolkit's logged MFU agrees (rel)", gap <= MFU_AGREEMENT, measured=round(gap, 4),
                          bound=MFU_AGREEMENT, why=f"logged {logged_mfu:.4f}, recomputed {mfu:.4f}"))
    return info, rows


def _matmul_peak(ctx: Ctx) -> tuple[float | None, str | None]:
    path = ctx.work / "matmul_peak.json"
    if not path.exists():
        return None, None
    found = json.loads(path.read_text())
    return found["flops"], found.get("device")


def _throughput_summary(ctx: Ctx, tokens_per_s: float, peak_mib: float | None, logged_mfu: float | None = None) -> None:
    import torch
    fpt = llama_flops_per_token(ctx.shape.model, ctx.shape.seq_len)
    measured_peak, _ = _matmul_peak(ctx)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    info, rows = mfu_checks(tokens_per_s, fpt, name, measured_peak, logged_mfu)
    ctx.info.update(tokens_per_s=round(tokens_per_s), flops_per_token=fpt, peak_gpu_mib=peak_mib, **info)
    ctx.checks += rows
    ctx.add("tokens/s", tokens_per_s > 0, measured=round(tokens_per_s),
            why=f"MFU {info['mfu_spec']} of spec, {info['mfu_measured']} of measured matmul peak")


def synthetic_rows(vocab: int, rows: int, seq: int, seed: int):
    """A learnable synthetic language over the first 1,024 ids of ``vocab``: each token's successor is
    fixed by one random table (a bigram model with one answer), but every row starts elsewhere. A model
    learns in a few steps that only those ids occur, then their successors; a held-out row is new to it
    but follows the same rule."""
    import torch
    vocab = min(vocab, 1024)
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, seq, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for i in range(1, seq):
        out[:, i] = table[out[:, i - 1]]
    return out


def phase_throughput_hf(ctx: Ctx) -> None:
    """The baseline: plain HF model + torch AdamW (fused on GPUs), bf16 autocast over fp32 weights (what
    HF Trainer's bf16 does), sdpa attention, the same shapes and step count, on distinct batches of
    ``synthetic_rows``; the loss of a held-out batch before and after training must fall."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    sh, dev = ctx.shape, ctx.device()
    torch.manual_seed(0)
    with torch.device(dev):  # initialized where it trains: a 1.1B model's init on the host takes seconds
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in sh.model.items()
                                                                 if k != "architectures"}), attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev == "cuda")
    dtype = torch.bfloat16 if sh.dtype == "bf16" else torch.float32
    vocab = sh.model["vocab_size"]
    batches = synthetic_rows(vocab, sh.steps * sh.accum * sh.micro_batch, sh.seq_len, seed=0).to(dev)
    held_out = synthetic_rows(vocab, sh.micro_batch, sh.seq_len, seed=1).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def loss_of(ids):
        with torch.autocast(dev, dtype=dtype, enabled=dtype != torch.float32):
            return model(input_ids=ids, labels=ids).loss

    with torch.no_grad():
        before = float(loss_of(held_out))
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in batches.split(sh.micro_batch * sh.accum):  # every step its own rows
        t = time.perf_counter()
        total = 0.0
        for ids in step.split(sh.micro_batch):
            loss = loss_of(ids) / sh.accum
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        sync()
        times.append(time.perf_counter() - t)
    with torch.no_grad():
        after = float(loss_of(held_out))
    step_s = statistics.median(times[sh.warmup:] or times)
    peak = round(torch.cuda.max_memory_allocated() / 2**20) if dev == "cuda" else None
    ctx.info.update(losses=[round(x, 4) for x in losses], held_out=[round(before, 4), round(after, 4)])
    ctx.add("losses finite", all(math.isfinite(x) for x in losses), measured=ctx.info["losses"][-1:])
    ctx.add("held-out batch's loss falls (before, after training; same language, unseen rows)",
            math.isfinite(after) and after < before, measured=ctx.info["held_out"])
    _throughput_summary(ctx, sh.micro_batch * sh.accum * sh.seq_len / step_s, peak)


def wall_clock_tokens_per_s(rows: list[dict], tokens_per_step: int, warmup: int) -> float | None:
    """tokens/s from the wall-clock times metrics.jsonl stamps on each step's row (not the toolkit's
    own ``tokens_per_s``): the median gap between consecutive rows after ``warmup`` steps."""
    import statistics
    stamps = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][max(warmup - 1, 0):]  # gaps[j]: step j + 2's time
    if not gaps or min(gaps) <= 0:
        return None
    return tokens_per_step / statistics.median(gaps)


def phase_throughput(ctx: Ctx, backend: str) -> None:
    """One backend on one rank through ``toolkit train`` (every step logged): tokens/s from the rows'
    wall-clock stamps and the configured tokens per step, MFU recomputed from them, the toolkit's
    logged MFU against it, the loss falling, which Adam ran."""
    import statistics
    sh = ctx.shape
    model_dir = ctx.work / "llama_throughput"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(sh.model))
    run = ctx.work / f"throughput_{backend}"
    shutil.rmtree(run, ignore_errors=True)
    sets = [f"model.name_or_path={model_dir}", f"model.dtype={sh.dtype}", f"data.seq_len={sh.seq_len}",
            f"train.steps={sh.steps}", f"train.micro_batch_size={sh.micro_batch}",
            f"train.global_batch_size={sh.micro_batch * sh.accum}", "train.eval_every=0", "train.log_every=1",
            "train.warmup_steps=2", "checkpoint.every=0", "train.export_hf=false",
            f"data.cache_dir={ctx.work / 'data_cache' / backend}", *BACKENDS[backend]]
    code, log = ctx.cmd(train_cmd(run, *sets), f"throughput_{backend}_train.log")
    rows = step_rows(run)
    ctx.info["exit"] = code
    ctx.info["notable"] = notable_fields(run)
    optimizer_check(ctx, ctx.info["notable"], backend)
    host_sync_check(ctx, rows, backend)
    if code != 0 or not rows:
        ctx.add("toolkit train ran", False, measured=code, why=log[-300:])
        return
    losses = [r["loss"] for r in rows]
    ctx.info.update(first_losses=[round(x, 5) for x in losses[:3]], last_loss=round(losses[-1], 5),
                    tokens_per_s_logged=round(statistics.median(r["tokens_per_s"] for r in rows[sh.warmup:] or rows)))
    ctx.add("losses finite", all(math.isfinite(x) for x in losses), measured=ctx.info["last_loss"])
    ctx.add("loss falls (last < first: distinct batches of the demo corpus)", losses[-1] < losses[0],
            measured=[ctx.info["first_losses"][0], ctx.info["last_loss"]])
    tokens = wall_clock_tokens_per_s(rows, sh.micro_batch * sh.accum * sh.seq_len, sh.warmup)
    if tokens is None:
        ctx.add("wall-clock steps in metrics.jsonl", False, why="fewer than two timed step rows")
        return
    reported = [r["mfu"] for r in rows[sh.warmup:] if r.get("mfu") is not None]
    _throughput_summary(ctx, tokens, _peak_gpu_mib_from(rows), statistics.median(reported) if reported else None)


def _peak_gpu_mib_from(rows: list[dict]) -> float | None:
    """A peak-memory field in metrics.jsonl if the run writes one (the parent also samples nvidia-smi)."""
    keys = [k for r in rows for k in r if "mem" in k.lower() and "peak" in k.lower()]
    return max((r[k] for r in rows for k in keys if isinstance(r.get(k), (int, float))), default=None)


def phase_multi_rank(ctx: Ctx) -> None:
    """ZeRO-3 DP=2 and megatron TP=2 through ``toolkit train`` on two ranks (two GPUs; two gloo ranks on
    a rehearsal): a finite, falling loss."""
    for name, sets in {"zero3_dp2": ["backend=deepspeed", "zero.stage=3"],
                       "megatron_tp2": ["backend=megatron", "megatron.tp=2"]}.items():
        run = ctx.work / f"multi_{name}"
        shutil.rmtree(run, ignore_errors=True)
        cmd = train_cmd(run, "data.seq_len=64", "train.steps=4", "train.global_batch_size=8",
                        "train.micro_batch_size=2", "train.eval_every=0", "train.log_every=1", "checkpoint.every=100",
                        f"data.cache_dir={ctx.work / 'data_cache' / name}", *sets)
        cmd[cmd.index("--nproc") + 1] = "2"
        code, log = ctx.cmd(cmd, f"multi_{name}.log")
        losses = [r["loss"] for r in step_rows(run)]
        ok = code == 0 and bool(losses) and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        ctx.add(f"{name}: trains, finite falling loss", ok, measured=[round(x, 4) for x in losses] or code,
                why="" if ok else log[-300:])


PHASE_FUNCS = {"environment": phase_environment, "preflight": phase_preflight, "matmul_peak": phase_matmul_peak,
               "throughput_hf": phase_throughput_hf, "fixed_batch": phase_fixed_batch,
               "throughput_deepspeed": lambda c: phase_throughput(c, "deepspeed"),
               "throughput_megatron": lambda c: phase_throughput(c, "megatron"),
               "tests_features": lambda c: phase_tests(c, "tests_features"),
               "tests_layer": lambda c: phase_tests(c, "tests_layer"),
               "tests_more": lambda c: phase_tests(c, "tests_more"),
               "multi_rank": phase_multi_rank}
assert set(PHASE_FUNCS) == {p.name for p in PHASES}


def run_child(args) -> int:
    ctx = Ctx(args)
    PHASE_FUNCS[args.phase](ctx)
    (args.work / f"phase_{args.phase}.json").write_text(json.dumps({"checks": ctx.checks, "info": ctx.info},
                                                                   default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results.json, summary.md, logs.tar.gz")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_check_work"),
                   help="scratch: installed wheels, runs, models (default /tmp/gpu_check_work)")
    p.add_argument("--rehearse", action="store_true", help="on a CPU machine: every phase, tiny shapes")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"no phase starts or runs past this (default {DEFAULT_BUDGET_S} s; the GPU machine stops a "
                        f"command at {COMMAND_LIMIT_S} s)")
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="the carried wheels (default .whl/)")
    p.add_argument("--machine-transformers", action="store_true",
                   help="install no carried transformers/peft: run the machine's own")
    p.add_argument("--only", nargs="*", default=[], help="run only these phases")
    p.add_argument("--full", action="store_true", help="also tests_more (more than one command's time on a GPU)")
    p.add_argument("--no-fused-adam", action="store_true", help="no background FusedAdam build")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every phase's timeout")
    p.add_argument("--timeouts", nargs="*", default=[], metavar="PHASE=SECONDS", help="per-phase timeouts")
    p.add_argument("--gpu-clear-wait-s", type=float, default=15, help=argparse.SUPPRESS)
    p.add_argument("--inject-hang", nargs="*", default=[], help=argparse.SUPPRESS)  # tests: these phases hang
    p.add_argument("--fused-adam-cmd", default=None, help=argparse.SUPPRESS)  # tests: a stand-in build
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase here
    p.add_argument("--phase-timeout-s", type=float, default=None, help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.phase:
        args.work = args.work.resolve()
        return run_child(args)
    unknown = set(args.only) - {ph.name for ph in PHASES}
    if unknown:
        p.error(f"--only {sorted(unknown)}: unknown phases; known: {[ph.name for ph in PHASES]}")
    return Run(args).go()


if __name__ == "__main__":
    sys.exit(main())
