"""GPU check: one command on a single-GPU machine that reaches no package registry, a PASS/FAIL verdict.

    python3 benchmarks/gpu_check.py --out $OUT                # the GPU machine, carrying .whl/ (570 s budget)
    python3 benchmarks/gpu_check.py --out OUT --rehearse      # a CPU machine: every phase, tiny shapes

It first installs the carried wheels (``.whl/``, ``benchmarks/gpu_wheels.py install``) into
``WORK/site`` and puts that first on every phase's PYTHONPATH (on a CPU with another Python than
3.12 the rehearsal runs ``gpu_wheels.py check`` instead: cp312 wheels do not install there).

The parent process uses the standard library only. Each phase runs as ``gpu_check.py --phase NAME``
in its own process session (``start_new_session``) under a hard timeout: on timeout the session gets
SIGTERM, then SIGKILL, and so does every process that carries the phase's token in its environment
(ranks that left the session too); the phase then fails if any such process is left, or if
``nvidia-smi --query-compute-apps`` still lists a process on the GPU. The DeepSpeed FusedAdam JIT
build starts in the background at t=0 and is joined before the first phase that trains.

``OUT`` gets three files only (the device tool brings back at most 8): ``results.json`` (rewritten
after every phase: each phase's status, seconds, peak memory, log tail, and every check with its
measured value beside its bound), ``summary.md`` (the PASS/FAIL table) and ``logs.tar.gz`` (every
phase's log). Scratch (installed wheels, runs, models) goes to ``--work``. Exit 0 only when every
check passed (SKIP is allowed only for what one GPU cannot do, e.g. multi-rank layouts).

Phases: environment, preflight (real imports of what was carried, a torch.compile probe, compiled
flex forward + backward), doctor, fused_adam (joins the background build), fixed_batch (both
backends' loss on one fixed batch of a model with non-uniform logits, fp32 without TF32), the GPU
test layer in three parts (tests/gpu: parity, kernels, train/resume/convert), the bf16 matmul peak,
throughput of a ~1.1B Llama in bf16 at sequence 4096 (plain HF + torch, DeepSpeed ZeRO-1, megatron
TP=1; tokens/s, MFU against the spec peak and the measured matmul peak, peak GPU memory), and
multi-rank layouts (only with 2 or more GPUs; otherwise SKIP "not possible on 1 GPU").

MFU = achieved model FLOP/s / peak (``toolkit/estimate/flops.py``): model FLOPs per token
``6 * N + 12 * n_layers * attention_width * seq_len`` (PaLM, appendix B), N without the input embedding.
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


# pytest_workers: the GPU layer's tests are single-rank processes, side by side on one GPU (16 cores)
GPU = Shape(LLAMA_1B, seq_len=4096, micro_batch=2, accum=2, steps=12, warmup=4, dtype="bf16", fixed_seq=256,
            matmul_n=8192, pytest_workers=6)
REHEARSAL = Shape(LLAMA_TINY, seq_len=64, micro_batch=2, accum=1, steps=4, warmup=1, dtype="fp32", fixed_seq=32,
                  matmul_n=256, pytest_workers=0,
                  test_filter={"tests_parity": "fp32 and llama", "tests_kernels": "sdpa or packed and llama",
                               "tests_train": "kill_resume and megatron"})  # the harness, not every test


@dataclass
class Phase:
    name: str
    timeout_s: float  # on the GPU
    rehearse_timeout_s: float
    aborts: bool = False  # the phase not finishing, or a critical check failing, stops the run
    trains: bool = False  # joins the background FusedAdam build first


PHASES = [
    Phase("environment", 60, 90, aborts=True),
    Phase("preflight", 150, 150, aborts=True),
    Phase("doctor", 60, 90),
    Phase("fixed_batch", 150, 240, trains=True),
    Phase("tests_parity", 150, 240, trains=True),
    Phase("tests_kernels", 120, 180),
    Phase("tests_train", 240, 300, trains=True),
    Phase("matmul_peak", 45, 60),
    Phase("throughput_hf", 100, 120),
    Phase("throughput_deepspeed", 120, 180, trains=True),
    Phase("throughput_megatron", 120, 180, trains=True),
    Phase("multi_rank", 150, 300, trains=True),
]


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
        self.deadline = time.monotonic() + args.budget_s
        self.results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "mode": "rehearsal (CPU, tiny shapes)" if args.rehearse else "GPU",
                              "command": " ".join(sys.argv), "phases": {}}
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

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
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
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=self.env, timeout=300)
        (self.logs / "wheels.log").write_text(proc.stdout + proc.stderr)
        ok = proc.returncode == 0
        if ok and site is not None:
            self.env["PYTHONPATH"] = os.pathsep.join([str(site), self.env["PYTHONPATH"]])
        self.record("wheels", {"status": "ok" if ok else "error", "seconds": round(time.monotonic() - started, 1),
                               "log_tail": (proc.stdout + proc.stderr)[-2000:],
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
        if self.background is None or "fused_adam" in self.results["phases"]:
            return
        s = self.background
        code = s.wait(max(min(self.shape_timeout(240), self.left() - 30), 1))
        left = s.stop() if code is None else s.stop(grace=2)
        text = s.log.read_text(errors="replace")
        ok = code == 0 and "FUSED_ADAM_OK" in text
        why = "" if ok else ("timed out" if code is None else f"exit {code}") + ": see log_tail (the toolkit " \
              "falls back to torch AdamW where it handles this; metrics.jsonl says which optimizer ran)"
        self.record("fused_adam", {"status": "ok" if code == 0 else "timeout" if code is None else "error",
                                   "seconds": s.seconds(), "left_behind": left, "log_tail": text[-2000:],
                                   "checks": [check("DeepSpeed FusedAdam JIT build (DS_SKIP_CUDA_CHECK=1)", ok,
                                                    measured=s.seconds(), why=why)]})

    def shape_timeout(self, gpu_s: float) -> float:
        return gpu_s * (1.5 if self.args.rehearse else 1.0)

    # --- phases ------------------------------------------------------------------------------------

    def run_phase(self, phase: Phase) -> dict:
        timeout = phase.rehearse_timeout_s if self.args.rehearse else phase.timeout_s
        timeout = dict(t.split("=") for t in self.args.timeouts).get(phase.name, timeout)
        timeout = float(timeout)
        if self.left() < 15:
            return {"status": "not run", "why": f"no time left ({self.left():.0f} s of the budget)"}
        timeout = max(min(timeout * self.args.timeout_scale, self.left() - 10), 1)
        result_file = self.work / f"phase_{phase.name}.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase.name, "--out", str(self.out),
               "--work", str(self.work)] + (["--rehearse"] if self.args.rehearse else [])
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
        for phase in PHASES:
            if self.args.only and phase.name not in self.args.only:
                continue
            if aborted:
                self.record(phase.name, {"status": "not run", "why": f"aborted: {aborted}"})
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
        text = table(self.results)
        (self.out / "summary.md").write_text(text + "\n")
        print(text, flush=True)
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
    lines = [f"# GPU check: {results.get('verdict')} ({results['mode']})", "",
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

    def add(self, *a, **k) -> dict:
        row = check(*a, **k)
        self.checks.append(row)
        return row

    def device(self) -> str:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def cmd(self, argv: list[str], log: str, timeout: float = 900, env: dict | None = None) -> tuple[int, str]:
        """A command inside the phase (its session is the phase's); its output in WORK/logs/log."""
        path = self.work / "logs" / log
        with open(path, "w") as f:
            code = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode
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
    _compile_probe(ctx)
    _toolkit_probe(ctx)
    _flex_probe(ctx, strict=False)
    _flex_probe(ctx, strict=True)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _compile_probe(ctx: Ctx) -> None:
    """torch.compile (Triton on GPUs: a C compiler and Python headers) of a small function, forward and
    backward, against eager."""
    import torch
    dev = ctx.device()
    x = torch.randn(64, 64, device=dev, requires_grad=True)

    def f(t):
        return (torch.sin(t) * t).sum()
    try:
        y = torch.compile(f)(x)
        (gx,) = torch.autograd.grad(y, x)
        x2 = x.detach().clone().requires_grad_()
        (gx2,) = torch.autograd.grad(f(x2), x2)
        err = _rel(gx, gx2)
        ctx.add("torch.compile forward + backward (rel to eager)", err < 1e-5, measured=err, bound=1e-5)
    except Exception as exc:  # noqa: BLE001
        ctx.add("torch.compile forward + backward", False, why=f"{type(exc).__name__}: {exc}"[:300])


def _toolkit_probe(ctx: Ctx) -> None:
    """The toolkit's own compile probe (``toolkit.adapters.compiled.compile_failure``, which decides its
    fallbacks: sdpa or math for flex, megatron's fusions off); SKIP where this toolkit has none."""
    try:
        from toolkit.adapters.compiled import compile_failure
    except ImportError as exc:
        ctx.add("the toolkit's compile probe", None, why=f"not in this toolkit ({exc})")
        return
    why = compile_failure(ctx.device())
    ctx.add("the toolkit's compile probe finds torch.compile working (no fallback)", why is None,
            why=why or "")


def _flex_probe(ctx: Ctx, strict: bool) -> None:
    """The toolkit's document attention through compiled flex_attention vs sdpa with the same boolean mask,
    forward and (on a GPU) backward; ``strict``: inside the toolkit's strict device mode (issue 28, 1)."""
    import torch

    from toolkit.adapters.attention import TokenLayout, attend
    dev = ctx.device()
    label = ("the toolkit's attend, flex kernel (compiled on GPUs), documents"
             + (", strict device mode" if strict else ""))
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 256, 32
    backward = dev == "cuda"  # torch has no flex_attention backward on CPU (inputs must not require grad)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(dev).requires_grad_(backward) for _ in range(3))
    docs = torch.cat([torch.zeros(b, s // 3), torch.ones(b, s - s // 3)], dim=1).long().to(dev)
    layout = TokenLayout.of(torch.zeros(b, s, dtype=torch.long, device=dev), document_ids=docs)
    try:
        if strict:
            from toolkit import device as tk_device
            tk_device.enable_strict()
        try:
            with torch.set_grad_enabled(backward):
                out = attend(q, k, v, layout, "flex", scale=d ** -0.5)
        finally:
            if strict:
                tk_device.disable_strict()
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=layout.allowed(None),
                                                               scale=d ** -0.5)
        err = _rel(out, ref)
        if backward:
            grad = torch.randn_like(out)
            out.backward(grad)
            ref.backward(grad)
            err = max([err] + [_rel(a.grad, b_.grad) for a, b_ in ((q, q2), (k, k2), (v, v2))])
        what = "forward + backward" if backward else "forward (no CPU backward)"
        ctx.add(f"{label}: {what} vs sdpa", err < 1e-4, measured=err, bound=1e-4)
    except Exception as exc:  # noqa: BLE001
        ctx.add(label, False, why=f"{type(exc).__name__}: {exc}"[:300])


def phase_doctor(ctx: Ctx) -> None:
    code, log = ctx.cmd([sys.executable, "-m", "toolkit", "doctor"], "doctor_out.txt", timeout=120)
    ctx.info["last_line"] = log.strip().splitlines()[-1] if log.strip() else None
    ctx.add("toolkit doctor exits 0", code == 0, measured=code)


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
                       init_range: float = FIXED_INIT_RANGE) -> dict:
    """Step-1 loss of each backend (one rank, fp32, TF32 off, the same seed: the same first batch, before
    any update) on the fixed model; ``perturb``: backend -> scale of its copy's perturbation;
    ``init_range`` 0.02 (HF's default) gives the near-uniform logits of the old step-1 check."""
    perturb = perturb or {}
    out = {}
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
                f"data.cache_dir={work / 'data_cache'}", *sets]
        log = work / "logs" / f"{run.name}.log"
        with open(log, "w") as f:
            code = subprocess.run(train_cmd(run, *sets), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=900).returncode
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
    losses = fixed_batch_losses(ctx.work, ctx.shape.fixed_seq)
    ctx.info["losses"] = losses
    ctx.checks += fixed_batch_checks(losses, vocab=2048, bound=FIXED_BOUND)


# --- the GPU test layer ---------------------------------------------------------------------------

TEST_SETS = {  # phase -> (files, -k expression); the rehearsal's expressions: REHEARSAL.test_filter
    "tests_parity": (["tests/gpu/test_gpu.py"], "megatron_logits or megatron_bf16"),
    "tests_kernels": (["tests/gpu/test_attention_gpu.py", "tests/gpu/test_packing_gpu.py"], ""),
    "tests_train": (["tests/gpu/test_gpu.py"], "not megatron_logits and not megatron_bf16"),
}


def phase_tests(ctx: Ctx, name: str) -> None:
    """``pytest -m gpu`` on one part of tests/gpu; one check per test (junit XML), and every value a test
    measured (tests/helpers/measure.py) beside its bound."""
    import xml.etree.ElementTree as ET
    junit, measured = ctx.work / f"{name}.xml", ctx.work / f"{name}_measured.jsonl"
    junit.unlink(missing_ok=True)
    measured.unlink(missing_ok=True)
    files, expression = TEST_SETS[name]
    expression = ctx.shape.test_filter.get(name, expression)
    args = [*files, *(["-k", expression] if expression else [])]
    workers = ["-n", str(ctx.shape.pytest_workers)] if ctx.shape.pytest_workers else []
    env = {"TOOLKIT_GPU_MEASURED": str(measured)}
    if ctx.rehearse:
        env["TOOLKIT_GPU_TESTS_ON_CPU"] = "1"
    code, log = ctx.cmd([sys.executable, "-m", "pytest", "-m", "gpu", *args, *workers, "-p", "no:cacheprovider",
                         "-q", "-rA", f"--junitxml={junit}"], f"{name}_pytest.log", env=env)
    ctx.info["pytest_exit"] = code
    values = [json.loads(x) for x in measured.read_text().splitlines()] if measured.exists() else []
    by_test: dict[str, list] = {}
    for v in values:
        by_test.setdefault(v["test"], []).append(v)
    if not junit.exists():
        ctx.add("pytest ran", False, measured=code, why=log[-300:])
        return
    cases = ET.parse(junit).getroot().iter("testcase")
    count = 0
    for case in cases:
        count += 1
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        numbers = {v["name"]: v["measured"] for v in by_test.get(case.get("name"), [])}
        bounds = {v["name"]: v["bound"] for v in by_test.get(case.get("name"), []) if v.get("bound") is not None}
        if failure is not None:
            ctx.add(test, False, measured=numbers or None, bound=bounds or None,
                    why=(failure.get("message") or "")[:300])
        elif skipped is not None:
            ctx.add(test, None, why=(skipped.get("message") or "")[:200])
        else:
            ctx.add(test, True, measured=numbers or None, bound=bounds or None)
    if count == 0:
        ctx.add("pytest collected tests", False, measured=0, why=log[-300:])
    elif code not in (0, 1):  # 1: some test failed (rows above); else pytest itself broke
        ctx.add("pytest ran", False, measured=code, why=log[-300:])


# --- throughput -----------------------------------------------------------------------------------

def model_flops_per_token(config: dict, seq: int) -> float:
    """The toolkit's own count (``toolkit/estimate/flops.py``, what ``toolkit train`` logs MFU with)."""
    from transformers import AutoConfig

    from toolkit.estimate.flops import flops_per_token
    from toolkit.plan.model import model_spec
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return flops_per_token(model_spec(AutoConfig.for_model(config["model_type"], **fields)), seq)


def spec_peak(dtype: str) -> float | None:
    try:
        from toolkit.estimate.flops import peak_flops
        return peak_flops(dtype)
    except Exception:  # noqa: BLE001 - no GPU, or an unknown one
        return None


def phase_matmul_peak(ctx: Ctx) -> None:
    """bf16 (fp32 on the CPU rehearsal) N^3 matmul: FLOP/s on random data, mean of 10 after 3 warm-ups."""
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
    ctx.info.update(tflops=round(flops / 1e12, 1), n=n, dtype=str(dtype))
    (ctx.work / "matmul_peak.json").write_text(json.dumps({"flops": flops}))
    spec = spec_peak("bf16")
    ctx.add("bf16 matmul peak measured", flops > 0 and math.isfinite(flops), measured=round(flops / 1e12, 1),
            why=f"TFLOP/s; spec {spec / 1e12 if spec else None}")


def _throughput_summary(ctx: Ctx, tokens_per_s: float, losses: list[float], peak_mib: float | None) -> None:
    fpt = model_flops_per_token(ctx.shape.model, ctx.shape.seq_len)
    spec = spec_peak(ctx.shape.dtype)
    peak_file = ctx.work / "matmul_peak.json"
    measured = json.loads(peak_file.read_text())["flops"] if peak_file.exists() else None
    ctx.info.update(tokens_per_s=round(tokens_per_s), flops_per_token=fpt, peak_gpu_mib=peak_mib,
                    mfu_spec=round(tokens_per_s * fpt / spec, 4) if spec else None,
                    mfu_measured=round(tokens_per_s * fpt / measured, 4) if measured else None,
                    first_losses=[round(x, 5) for x in losses[:3]], last_loss=round(losses[-1], 5) if losses else None)
    ok = bool(losses) and all(math.isfinite(x) for x in losses)
    mfu_measured = ctx.info["mfu_measured"]
    # Above the matmul rate measured a minute ago, tokens/s or the FLOP count is wrong (on a CPU
    # rehearsal the tiny matmul's rate says nothing).
    ctx.add("MFU against the measured matmul peak <= 1", None if ctx.rehearse or mfu_measured is None
            else mfu_measured <= 1.0, measured=mfu_measured, bound=1.0,
            why="CPU rehearsal" if ctx.rehearse else "" if mfu_measured is not None else "no matmul_peak result")
    ctx.add("losses finite", ok, measured=ctx.info["last_loss"])
    ctx.add("loss falls (last < first)", ok and losses[-1] < losses[0], measured=[ctx.info["first_losses"][:1],
                                                                               ctx.info["last_loss"]])
    ctx.add("tokens/s", tokens_per_s > 0, measured=round(tokens_per_s),
            why=f"MFU {ctx.info['mfu_spec']} of spec, {ctx.info['mfu_measured']} of measured matmul peak")


def phase_throughput_hf(ctx: Ctx) -> None:
    """The baseline: plain HF model + torch AdamW (fused on GPUs), bf16 autocast over fp32 weights (what
    HF Trainer's bf16 does), sdpa attention, the same shapes and step count; random tokens."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    sh, dev = ctx.shape, ctx.device()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in sh.model.items() if k != "architectures"}),
                                             attn_implementation="sdpa").to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev == "cuda")
    dtype = torch.bfloat16 if sh.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    fixed = [torch.randint(0, sh.model["vocab_size"], (sh.micro_batch, sh.seq_len), generator=g).to(dev)
             for _ in range(sh.accum)]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(sh.steps):
        t = time.perf_counter()
        total = 0.0
        for ids in fixed:
            with torch.autocast(dev, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(input_ids=ids, labels=ids).loss / sh.accum
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[sh.warmup:] or times)
    peak = round(torch.cuda.max_memory_allocated() / 2**20) if dev == "cuda" else None
    _throughput_summary(ctx, sh.micro_batch * sh.accum * sh.seq_len / step_s, losses, peak)


def phase_throughput(ctx: Ctx, backend: str) -> None:
    """One backend on one rank through ``toolkit train``: median tokens/s of the steps after warm-up."""
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
            f"data.cache_dir={ctx.work / 'data_cache'}", *BACKENDS[backend]]
    code, log = ctx.cmd(train_cmd(run, *sets), f"throughput_{backend}_train.log")
    rows = step_rows(run)
    ctx.info["exit"] = code
    ctx.info["notable"] = notable_fields(run)
    optimizer_check(ctx, ctx.info["notable"], backend)
    host_sync_check(ctx, rows, backend)
    if code != 0 or not rows:
        ctx.add("toolkit train ran", False, measured=code, why=log[-300:])
        return
    timed = rows[sh.warmup:] or rows
    peak = _peak_gpu_mib_from(rows)
    _throughput_summary(ctx, statistics.median(r["tokens_per_s"] for r in timed), [r["loss"] for r in rows], peak)
    reported = [r["mfu"] for r in timed if r.get("mfu") is not None]
    ctx.info["mfu_reported_by_toolkit"] = round(statistics.median(reported), 4) if reported else None
    ours, theirs = ctx.info["mfu_spec"], ctx.info["mfu_reported_by_toolkit"]
    agree = None if ours is None or theirs is None else abs(ours - theirs) <= 0.02 * ours
    ctx.add("toolkit's logged MFU = tokens/s x FLOPs / spec peak (rel 2%)", agree, measured=theirs, bound=ours,
            why="" if agree is not None else "no MFU (the toolkit logs it on GPUs only)")


def _peak_gpu_mib_from(rows: list[dict]) -> float | None:
    """A peak-memory field in metrics.jsonl if the run writes one (the parent also samples nvidia-smi)."""
    keys = [k for r in rows for k in r if "mem" in k.lower() and "peak" in k.lower()]
    return max((r[k] for r in rows for k in keys if isinstance(r.get(k), (int, float))), default=None)


def phase_multi_rank(ctx: Ctx) -> None:
    import torch
    n = torch.cuda.device_count()
    if n < 2 and not ctx.rehearse:
        ctx.add("multi-rank layouts (ZeRO-3 DP=2, megatron TP=2)", None,
                why=f"not possible on {n} GPU: two NCCL ranks cannot share one GPU")
        return
    nproc = 2
    for name, sets in {"zero3_dp2": ["backend=deepspeed", "zero.stage=3"],
                       "megatron_tp2": ["backend=megatron", "megatron.tp=2"]}.items():
        run = ctx.work / f"multi_{name}"
        shutil.rmtree(run, ignore_errors=True)
        cmd = train_cmd(run, "data.seq_len=64", "train.steps=4", "train.global_batch_size=8",
                        "train.micro_batch_size=2", "train.eval_every=0", "train.log_every=1", "checkpoint.every=100",
                        f"data.cache_dir={ctx.work / 'data_cache'}", *sets)
        cmd[cmd.index("--nproc") + 1] = str(nproc)
        code, log = ctx.cmd(cmd, f"multi_{name}.log")
        losses = [r["loss"] for r in step_rows(run)]
        ok = code == 0 and bool(losses) and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        ctx.add(f"{name}: trains, finite falling loss", ok, measured=[round(x, 4) for x in losses] or code,
                why="" if ok else log[-300:])


PHASE_FUNCS = {"environment": phase_environment, "preflight": phase_preflight, "doctor": phase_doctor,
               "fixed_batch": phase_fixed_batch, "matmul_peak": phase_matmul_peak,
               "tests_parity": lambda c: phase_tests(c, "tests_parity"),
               "tests_kernels": lambda c: phase_tests(c, "tests_kernels"),
               "tests_train": lambda c: phase_tests(c, "tests_train"),
               "throughput_hf": phase_throughput_hf,
               "throughput_deepspeed": lambda c: phase_throughput(c, "deepspeed"),
               "throughput_megatron": lambda c: phase_throughput(c, "megatron"),
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
    p.add_argument("--budget-s", type=float, default=570, help="no phase starts or runs past this (seconds)")
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="the carried wheels (default .whl/)")
    p.add_argument("--machine-transformers", action="store_true",
                   help="install no carried transformers/peft: run the machine's own")
    p.add_argument("--only", nargs="*", default=[], help="run only these phases")
    p.add_argument("--no-fused-adam", action="store_true", help="no background FusedAdam build")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every phase's timeout")
    p.add_argument("--timeouts", nargs="*", default=[], metavar="PHASE=SECONDS", help="per-phase timeouts")
    p.add_argument("--gpu-clear-wait-s", type=float, default=15, help=argparse.SUPPRESS)
    p.add_argument("--inject-hang", nargs="*", default=[], help=argparse.SUPPRESS)  # tests: these phases hang
    p.add_argument("--fused-adam-cmd", default=None, help=argparse.SUPPRESS)  # tests: a stand-in build
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase here
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
