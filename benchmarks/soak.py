"""Soak the restart policy: one job through M random faults of every kind the injector has, on either
backend, against the same job uninterrupted.

    python benchmarks/soak.py --backend deepspeed --faults 50 --seed 0      # ZeRO-2, 2 ranks
    python benchmarks/soak.py --backend megatron --faults 50 --seed 0       # TP 2 on 2 ranks
    python benchmarks/soak.py --backend megatron --set megatron.tp=1 --set megatron.pp=2 --faults 50

The job is the demo model (seq 32, global batch 8) with asynchronous saves every ``--every`` steps (so
the background writer's faults can fire), an eval every 5 checkpoints, the final export,
``restart.hang_timeout_s=10`` and replicas compared every step (under ZeRO-2 a replica perturbed
between two checks is overwritten by the next all-gather, its step's gradients already changed);
``--set`` adds or overrides any config key for both runs. DeepSpeed's JIT ops are built once first,
in a copy of the environment's folder (``private_op_folder``). Faults are drawn from every kind of
``toolkit/watch/faults.py`` (each at least once when ``--faults`` allows, ``LEFT_OUT`` says which
are not and why), each at its own step, on a random rank where the kind allows. ``corrupt`` and
``hang_in_load`` act on checkpoint ``c`` only when a restart resumes it, so each comes with a crash
at ``c + every - 1`` that makes one.

Reported (and written to ``benchmarks/results/soak_<backend>.json``, or ``--out``):
- faults by kind: scheduled, fired (``RUN_DIR/faults_fired``), restarts they caused, recovery times;
- per restart: its cause, the step the job had reached, the checkpoint resumed, steps rolled back.
  Asserted: each restart resumes the newest checkpoint that can exist, i.e. at most one save interval
  back unless a checkpoint in between was lost to an injected fault (corrupted, a failed write, a
  killed save) or was in flight (asynchronous: written, not yet committed);
- recovery time (``events.jsonl``: failure detected -> first step done, and its breakdown_s);
- whether the final losses equal the uninterrupted run's bit for bit;
- goodput: the share of wall time (every launch, from the first command to the last exit) spent on
  the final computation of each step; the rest is broken down (setup, recomputed steps, recovery,
  hang detection, saves, evals, export). The uninterrupted run's goodput is the same job's ceiling;
  ``toolkit/estimate/goodput.py`` fed the soak's own figures gives the model's prediction.
``--at-scale`` only models the defaults' goodput for two larger jobs (no training).
The command exits 1 when losses differ or a restart resumed an older checkpoint than it could have.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from toolkit.watch.faults import FAULT_KINDS  # noqa: E402

PREEMPTED_EXIT = 75  # sigterm, sigint: the job saved and stopped; the same command resumes it

BACKENDS = {"deepspeed": ["zero.stage=2"], "megatron": ["backend=megatron", "megatron.tp=2"]}
STEP_KINDS = ("kill", "hang", "raise", "abort", "sigterm", "sigint", "slow", "diverge")  # at a step boundary / mid-step
SAVE_KINDS = ("kill_in_save", "hang_in_save", "enospc", "slow_save", "kill_in_persist", "raise_in_persist")
AFTER_CRASH = ("corrupt", "hang_in_load")  # at checkpoint c; act when a restart resumes c
CRASH = ("kill", "raise", "abort", "hang")  # what makes that restart
OTHER_KINDS = ("slow_eval", "slow_export")
LEFT_OUT = {"overflow": "fp16 only (a loss-scaler skip): the demo job trains in fp32",
            "host_collective": "a probe that strict device mode is on, not a fault (it all-reduces on one rank)",
            "hang_in_step": "hang's recovery from inside a step (tests/e2e/test_hang_phases.py: the step after an "
                            "eval or a save is judged by the step's budget)"}
RANK0_KINDS = ("corrupt", "kill_in_persist", "raise_in_persist")  # rank 0 commits; local rank 0 persists
SLOW_MS = {"slow": 20, "slow_save": 300, "slow_eval": 300, "slow_export": 50}
RECOVERY_PARTS = ("backoff", "torn_down", "rendezvous", "ranks_started", "rank_up", "checkpoint_loaded",
                  "first_step_done")  # events.jsonl's breakdown_s: seconds from the failure's detection
LOSES_CHECKPOINT = ("corrupt", "enospc", "kill_in_save", "hang_in_save", "kill_in_persist", "raise_in_persist")


# --- the job --------------------------------------------------------------------------------------

def job_sets(backend: str, steps: int, every: int, extra: list[str]) -> list[str]:
    """The soak's config for both runs (restart keys apply to the soak only: they change no loss)."""
    return ["data.seq_len=32", f"train.steps={steps}", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.warmup_steps=2", f"train.eval_every={every * 5}", "train.eval_batches=2",
            f"checkpoint.every={every}", "checkpoint.keep_last=3", "checkpoint.async_save=true",
            "restart.backoff_s=0.5", "restart.hang_timeout_s=10",
            "restart.divergence_every=1", *BACKENDS[backend], *extra]


def setting(sets: list[str], key: str, default: str) -> str:
    values = [s.partition("=")[2] for s in sets if s.partition("=")[0] == key]
    return values[-1] if values else default


def run_toolkit(args: list[str], env: dict, log: Path) -> int:
    """``python -m toolkit ARGS`` as a user runs it, its output appended to ``log``; the exit code."""
    with open(log, "a") as out:
        return subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=REPO, env={**os.environ, **env},
                              stdout=out, stderr=subprocess.STDOUT, timeout=4 * 3600).returncode


def train_args(run_dir: Path, sets: list[str], nproc: int, *extra: str) -> list[str]:
    args = ["train", "--run-dir", str(run_dir), "--nproc", str(nproc), *extra]
    for s in sets:
        args += ["--set", s]
    return args


BUILD_OPS = """
from toolkit.adapters.deepspeed.engine import _install_op_caches
_install_op_caches()
from deepspeed.accelerator import get_accelerator
from deepspeed.ops import op_builder
op_builder.FusedAdamBuilder().load()
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
"""


def private_op_folder(work: Path) -> None:
    """Build DeepSpeed's JIT ops once, before the runs, in a folder of this soak's own (a copy of the
    environment's, so usually nothing is built). On a machine shared with other jobs of this
    environment, ops they rebuild would otherwise be rebuilt in a soak rank's load (minutes on 2
    busy cores: over the load budget), and a rank killed while it builds leaves torch's build lock
    behind, on which every later start waits."""
    from toolkit.compat.torch_extensions import extensions_dir
    private = work / "torch_extensions"
    if not private.exists() and extensions_dir().exists():
        shutil.copytree(extensions_dir(), private, ignore=shutil.ignore_patterns("lock"))
    os.environ["TORCH_EXTENSIONS_DIR"] = str(private)
    subprocess.run([sys.executable, "-c", BUILD_OPS], cwd=REPO, check=True, timeout=3600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def train(run_dir: Path, sets: list[str], nproc: int, faults: str, max_restarts: int, launch) -> dict:
    """``toolkit train`` until it finishes; a preempted job (exit 75) is run again, as a scheduler would.
    ``launch(args, env)`` runs the command and gives its exit code."""
    args = train_args(run_dir, [*sets, f"restart.max_restarts={max_restarts}"], nproc)
    start, launches, code = time.time(), 0, PREEMPTED_EXIT
    while code == PREEMPTED_EXIT:
        launches += 1
        code = launch(args, {"TOOLKIT_FAULT": faults})
    if code:
        raise SystemExit(f"soak: toolkit train exited {code}; events in {run_dir}/events.jsonl, output in {run_dir}.log")
    return {"start": start, "end": time.time(), "launches": launches}


def prepare_data(run_dir: Path, sets: list[str], nproc: int, launch) -> None:
    """Tokenize and pack the data once (``--dry-run``) so that neither run's setup pays for it."""
    if code := launch(train_args(run_dir, sets, nproc, "--dry-run"), {}):
        raise SystemExit(f"soak: toolkit train --dry-run exited {code}; output in {run_dir}.log")


# --- the faults -----------------------------------------------------------------------------------

def fault_mix(sets: list[str], nproc: int) -> tuple[str, ...]:
    """Every kind the injector has that this job can survive, minus those its settings rule out."""
    known = set(STEP_KINDS + SAVE_KINDS + AFTER_CRASH + OTHER_KINDS) | set(LEFT_OUT)
    if known != set(FAULT_KINDS):
        raise SystemExit(f"soak: the injector's kinds changed: new {sorted(set(FAULT_KINDS) - known)}, gone "
                         f"{sorted(known - set(FAULT_KINDS))}; place them in benchmarks/soak.py's mix or LEFT_OUT")
    mix = [k for k in STEP_KINDS + SAVE_KINDS + AFTER_CRASH + OTHER_KINDS]
    backend = setting(sets, "backend", "deepspeed")
    model_parallel = (int(setting(sets, "megatron.tp", "1")) * int(setting(sets, "megatron.pp", "1"))
                      if backend == "megatron" else 1)
    if nproc // model_parallel < 2 or setting(sets, "zero.stage", "2") == "3":
        mix.remove("diverge")  # no replicated parameters to compare
    if setting(sets, "checkpoint.async_save", "false").lower() != "true":
        mix = [k for k in mix if k not in ("kill_in_persist", "raise_in_persist")]
    if setting(sets, "train.export_hf", "true").lower() != "true":
        mix.remove("slow_export")
    return tuple(mix)


def schedule(n: int, steps: int, every: int, eval_every: int, nproc: int, mix: tuple[str, ...],
             rng: random.Random) -> list[dict]:
    """``n`` faults, each at a step of its own: every kind of ``mix`` once (when ``n`` allows), the rest
    drawn at random. A fault of ``AFTER_CRASH`` brings its crash (counted in ``n``)."""
    if every < 3:
        raise SystemExit("soak: --every must be at least 3 (corrupt and hang_in_load need a crash two steps "
                         "after their checkpoint, once the asynchronous save is committed)")
    free = {"plain": {s for s in range(2, steps) if s % every},
            "ckpt": set(range(every, steps, every)), "eval": set(range(eval_every, steps, eval_every))}
    kinds = rng.sample(mix, len(mix))
    faults: list[dict] = []

    def take(slot: str, choices=None) -> int:
        options = sorted(free[slot] if choices is None else free[slot] & set(choices))
        if not options:
            raise LookupError(slot)
        step = rng.choice(options)
        free[slot].discard(step)
        return step

    def add(kind: str, step: int) -> None:
        fault = {"kind": kind, "step": step, "rank": 0 if kind in RANK0_KINDS else rng.randrange(nproc)}
        if kind in SLOW_MS:
            fault["ms"] = SLOW_MS[kind]
        faults.append(fault)

    while len(faults) < n:
        kind = kinds.pop() if kinds else rng.choice(mix)
        try:
            if kind in AFTER_CRASH:
                if len(faults) + 2 > n:
                    continue
                ckpt = take("ckpt", [c for c in free["ckpt"] if c + every - 1 in free["plain"]])
                add(kind, ckpt)
                add(rng.choice(CRASH), take("plain", [ckpt + every - 1]))
            elif kind in SAVE_KINDS:
                add(kind, take("ckpt"))
            elif kind == "slow_eval":
                add(kind, take("eval"))
            elif kind == "slow_export":
                if any(f["kind"] == kind for f in faults):
                    continue
                add(kind, steps)
            else:
                add(kind, take("plain"))
        except LookupError as exc:
            raise SystemExit(f"soak: no free {exc.args[0]} step left for {n} faults in {steps} steps; "
                             f"raise --steps") from None
    return sorted(faults, key=lambda f: f["step"])


def spec(faults: list[dict]) -> str:
    return ";".join(":".join([f["kind"], *(f"{k}={f[k]}" for k in ("step", "rank", "ms") if k in f)])
                    for f in faults)


def fired(run_dir: Path, faults: list[dict], steps: int) -> list[bool]:
    """Faults that acted: those the injector marks once fired; a slow kind acts whenever its step runs."""
    path = run_dir / "faults_fired"
    marks = set(path.read_text().split()) if path.exists() else set()
    return [f["kind"].startswith("slow") and f["step"] <= steps or f"{f['kind']}:{f['step']}:{f['rank']}" in marks
            for f in faults]


# --- what happened --------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def attempts(records: list[dict]) -> list[dict]:
    """metrics.jsonl cut where rank 0 started training again (its ``parameters`` record): for each
    attempt its start time, the step it resumed (0 fresh, None when its load never finished) and the
    steps it finished."""
    out: list[dict] = []
    for r in records:
        if r.get("event") == "parameters":
            out.append({"time": r["time"], "resumed": None, "steps": []})
        elif out and r.get("event") == "resume":
            out[-1]["resumed"] = r["step"]
        elif out and "loss" in r:
            out[-1]["steps"].append(r["step"])
    for a in out:
        if a["resumed"] is None and a["steps"]:
            a["resumed"] = a["steps"][0] - 1  # started fresh
    return out


def restart_windows(events: list[dict]) -> list[dict]:
    """One entry per restart (``restart`` event) or preemption (``preempt_saved``: the job saved and
    exited, and was run again): the events that led to it, and the ``recovered`` event that closed
    it (None when the next attempt failed before its first step, or after a preemption)."""
    windows, pending = [], []
    for e in events:
        if e["kind"] == "restart":
            windows.append({"time": e["time"], "events": pending, "recovered": None, "preempted": False})
            pending = []
        elif e["kind"] == "preempt_saved":
            windows.append({"time": e["time"], "events": [e], "recovered": None, "preempted": True})
            pending = []
        elif e["kind"] == "recovered" and windows and windows[-1]["recovered"] is None and not windows[-1]["preempted"]:
            windows[-1]["recovered"] = e
        elif e["kind"] in ("failure", "hang", "checkpoint_failed", "divergence"):
            pending.append(e)
    return windows


def candidates(window: dict) -> tuple[tuple[str, ...], int | None]:
    """The fault kinds that explain a restart's events, and the step they name."""
    ev = window["events"]
    by_kind = {e["kind"]: e for e in ev}
    if window["preempted"]:
        return ("sigterm", "sigint"), by_kind.get("preempt_saved", {}).get("step")
    if "hang" in by_kind:
        h = by_kind["hang"]
        phase = h.get("phase", "step")
        kinds = {"save": ("hang_in_save",), "load": ("hang_in_load",), "reshard": ("hang_in_load",)}.get(
            phase, ("hang",))
        return kinds, h.get("step")
    if "checkpoint_failed" in by_kind:
        c = by_kind["checkpoint_failed"]
        return (("enospc",) if c.get("disk_full") else ("raise_in_persist",)), c["step"]
    if "divergence" in by_kind:
        return ("diverge",), by_kind["divergence"]["step"]
    failures = [e for e in ev if e["kind"] == "failure"]
    signals = {e.get("signal") for e in failures}
    step = max((e["step"] for e in failures if e.get("step") is not None), default=None)
    if "SIGABRT" in signals:
        return ("abort",), step
    if "SIGKILL" in signals:
        return ("kill", "kill_in_save", "kill_in_persist"), step
    return ("raise",), step


def match_causes(windows: list[dict], faults: list[dict], did_fire: list[bool]) -> list[int | None]:
    """For each restart, the index of the fault that caused it: a fired fault of a kind its events
    name, not matched yet, nearest the step they name (ties: the earliest scheduled)."""
    used: set[int] = set()
    out = []
    for w in windows:
        kinds, step = candidates(w)
        pool = [i for i, f in enumerate(faults) if did_fire[i] and i not in used and f["kind"] in kinds]
        if not pool:
            out.append(None)
            continue
        best = min(pool, key=lambda i: (abs(faults[i]["step"] - (step or 0)), faults[i]["step"]))
        used.add(best)
        out.append(best)
    return out


def rollbacks(tries: list[dict], windows: list[dict], faults: list[dict], did_fire: list[bool], every: int,
              async_save: bool) -> list[dict]:
    """Per restart: the step the attempt before it reached, the checkpoint the attempt after it
    resumed, the steps rolled back (their sum over restarts is every step computed twice), and
    whether that checkpoint was the newest one that can exist: every checkpoint step in between was
    lost to a fault, was the step where the job failed (before or while saving it), or was the one
    save in flight (asynchronous saves: written, not committed)."""
    lost = {f["step"] for f, ok in zip(faults, did_fire) if ok and f["kind"] in LOSES_CHECKPOINT}
    out, seen = [], set()
    for w in windows:
        before = [i for i, a in enumerate(tries) if a["time"] < w["time"]]
        after = [a for a in tries if a["time"] > w["time"] and a["resumed"] is not None]
        resumed = after[0]["resumed"] if after else None
        if not before or before[-1] in seen or resumed is None:  # that attempt's loss is counted already
            out.append({"reached": None, "resumed": resumed, "rolled_back": 0, "newest_possible": True})
            continue
        seen.add(before[-1])
        prev = tries[before[-1]]
        reached = prev["steps"][-1] if prev["steps"] else (prev["resumed"] if prev["resumed"] is not None else resumed)
        between = list(range(resumed + every - resumed % every, reached + 1, every))
        newest_due = max(between, default=None)
        unexplained = [c for c in between if c not in lost and c != reached and not (async_save and c == newest_due)]
        out.append({"reached": reached, "resumed": resumed, "rolled_back": reached - resumed,
                    "lost_to_faults": sorted(set(between) & lost), "unexplained": unexplained,
                    "newest_possible": not unexplained})
    return out


def goodput(run: dict, records: list[dict], events: list[dict], steps: int) -> dict:
    """Share of wall time on the final computation of each step, and where the rest went."""
    wall = run["end"] - run["start"]
    computed = [r for r in records if "loss" in r]
    final = {r["step"]: r["step_s"] for r in computed}  # the last computation of each step counts
    useful = sum(final.values())
    recomputed = sum(r["step_s"] for r in computed) - useful
    first = computed[0]["time"] - computed[0]["step_s"] if computed else run["end"]
    parts = {
        "useful_steps": useful,
        "setup": first - run["start"],  # launch, rank start, build, load: until the first step begins
        "recomputed_steps": recomputed,
        "hang_detection": sum(e.get("seconds_without_progress", 0) for e in events if e["kind"] == "hang"),
        "recovery": sum(e["time_to_recover_s"] or 0 for e in events if e["kind"] == "recovered"),
        "checkpoint_blocked": sum(r.get("checkpoint_blocked_s", 0) for r in records if r.get("event") == "checkpoint"),
        "eval": sum(r.get("eval_s", 0) for r in records if "eval_loss" in r),
    }
    parts["other"] = wall - sum(parts.values())  # export, preempted relaunches, teardown, logging
    return {"goodput": round(useful / wall, 4), "wall_s": round(wall, 1),
            "seconds": {k: round(v, 1) for k, v in parts.items()},
            "share": {k: round(v / wall, 4) for k, v in parts.items()}}


def modelled_goodput(run: dict, records: list[dict], events: list[dict], every: int) -> dict | None:
    """``toolkit/estimate/goodput.py`` fed with this soak's own figures, next to the goodput measured
    over the same parts of the wall time (useful and recomputed steps, saves, recovery, hang
    detection; setup, evals, export and preempted relaunches are outside the model). The soak injects
    its faults at steps, so they strike only work: MTBF = (useful + recomputed + save seconds) per
    restart, with no failure during a recovery; step: the mean; save: the mean blocked time;
    recovery: (detection + recovery seconds) per restart."""
    from toolkit.estimate.goodput import goodput as modelled
    restarts = sum(e["kind"] == "restart" for e in events)
    if not restarts:
        return None
    g = goodput(run, records, events, 0)["seconds"]
    steps = [r["step_s"] for r in records if "loss" in r]
    saves = [r["checkpoint_blocked_s"] for r in records if r.get("event") == "checkpoint"]
    figures = {"mtbf_s": (g["useful_steps"] + g["recomputed_steps"] + g["checkpoint_blocked"]) / restarts,
               "step_s": statistics.mean(steps), "save_every": every,
               "save_s": statistics.mean(saves) if saves else 0.0,
               "recovery_s": (g["recovery"] + g["hang_detection"]) / restarts}
    accounted = sum(g[k] for k in ("useful_steps", "recomputed_steps", "recovery", "hang_detection", "checkpoint_blocked"))
    return {**{k: round(v, 3) for k, v in figures.items()},
            "predicted": round(modelled(**figures, fail_in_recovery=False), 4),
            "measured_same_parts": round(g["useful_steps"] / accounted, 4)}


AT_SCALE = {  # name: (HF config fields, config overrides, nodes of 8 GPUs)
    "Llama-7B-like, ZeRO-2, 64 H100": (
        dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000),
        ["data.seq_len=4096", "train.global_batch_size=512", "train.micro_batch_size=1", "model.dtype=bf16",
         "zero.stage=2"], 8),
    "Llama-70B-like, megatron TP8 PP4, 1024 H100": (
        dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
             num_key_value_heads=8, vocab_size=128256),
        ["data.seq_len=4096", "train.global_batch_size=1024", "train.micro_batch_size=1", "model.dtype=bf16",
         "backend=megatron", "megatron.tp=8", "megatron.pp=4"], 128),
}
SCALE_ASSUMPTIONS = {"storage_gb_per_s_per_node": 2.0, "rank_start_s": 60.0, "crash_detect_s": 1.0,
                     "mtbf_hours": [3, 12, 48]}


def at_scale() -> dict:
    """The goodput the defaults give (``checkpoint.every``, synchronous saves, ``restart.backoff_s``: a
    job that got past its previous failure restarts after the first backoff, ``hang_timeout_s``) for
    two larger jobs: step time from the estimator (``toolkit estimate``: H100 SXM, MFU 0.4), save and
    load time from the checkpoint's bytes over the nodes' storage bandwidth, a rank start of
    ``SCALE_ASSUMPTIONS['rank_start_s']``; a crash is seen in about a second, a hang after
    ``hang_timeout_s``."""
    from transformers import LlamaConfig

    from toolkit.config import load_config
    from toolkit.estimate.goodput import checkpoint_seconds, model, recovery_seconds
    from toolkit.estimate.steptime import Cluster, step_time
    from toolkit.plan.checks import check_layout
    from toolkit.plan.model import model_spec
    a = SCALE_ASSUMPTIONS
    jobs = {}
    for name, (hf, sets, nodes) in AT_SCALE.items():
        spec, cfg = model_spec(LlamaConfig(**hf)), load_config(None, sets)
        lay = check_layout(cfg, spec, nodes * 8)
        step_s = step_time(cfg, spec, lay, Cluster(nodes=nodes)).total_s
        io_s = checkpoint_seconds(spec.total, nodes, a["storage_gb_per_s_per_node"])
        r = cfg.restart
        backoff = r.backoff_s  # the agent's backoff starts over once the job got past its last failure
        recovery = {"crash": recovery_seconds(io_s, step_s, start_s=a["rank_start_s"], backoff_s=backoff,
                                              detect_s=a["crash_detect_s"]),
                    "hang": recovery_seconds(io_s, step_s, start_s=a["rank_start_s"], backoff_s=backoff,
                                             detect_s=r.hang_timeout_s)}
        jobs[name] = {"params": spec.total, "layout": lay.describe(), "step_s": round(step_s, 2),
                      "save_every": cfg.checkpoint.every, "save_s": round(io_s, 2),
                      "recovery_s": {k: round(v, 1) for k, v in recovery.items()},
                      "goodput": {f"mtbf_{h}h": {k: model(h * 3600.0, step_s, cfg.checkpoint.every, io_s, v).as_dict()
                                                 for k, v in recovery.items()} for h in a["mtbf_hours"]}}
    return {"assumptions": a, "jobs": jobs}


def quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)
    return {"n": len(v), "median": round(statistics.median(v), 2),
            "p90": round(v[min(len(v) - 1, int(0.9 * len(v)))], 2), "max": round(v[-1], 2)}


def summarize(soak_dir: Path, base_dir: Path, soak_run: dict, base_run: dict, faults: list[dict],
              steps: int, every: int, async_save: bool) -> dict:
    events = read_jsonl(soak_dir / "events.jsonl")
    records = read_jsonl(soak_dir / "metrics.jsonl")
    base_records = read_jsonl(base_dir / "metrics.jsonl")
    did_fire = fired(soak_dir, faults, steps)
    windows = restart_windows(events)
    causes = match_causes(windows, faults, did_fire)
    backs = rollbacks(attempts(records), windows, faults, did_fire, every, async_save)
    final = {r["step"]: r["loss"] for r in records if "loss" in r}
    base = {r["step"]: r["loss"] for r in base_records if "loss" in r}

    restarts = []
    for w, cause in zip(windows, causes):
        rec = w["recovered"] or {}
        if w["preempted"]:  # the same command run again: checkpoint saved -> first step of the new launch
            first = next((r["time"] for r in records if "loss" in r and r["time"] > w["time"]), None)
            rec = {"time_to_recover_s": round(first - w["time"], 2) if first else None}
        restarts.append({"cause": faults[cause]["kind"] if cause is not None else "unknown",
                         "fault_step": faults[cause]["step"] if cause is not None else None,
                         "preemption": w["preempted"], "time_to_recover_s": rec.get("time_to_recover_s"),
                         "breakdown_s": rec.get("breakdown_s")})
    by_kind: dict[str, dict] = {}
    for i, f in enumerate(faults):
        k = by_kind.setdefault(f["kind"], {"scheduled": 0, "fired": 0, "restarts": 0, "recover_s": []})
        k["scheduled"] += 1
        k["fired"] += did_fire[i]
    for r in restarts:
        k = by_kind.setdefault(r["cause"], {"scheduled": 0, "fired": 0, "restarts": 0, "recover_s": []})
        k["restarts"] += 1
        if r["time_to_recover_s"] is not None:
            k["recover_s"].append(r["time_to_recover_s"])
    for k in by_kind.values():
        k["recover_s"] = quantiles(k.pop("recover_s"))

    recover = [r["time_to_recover_s"] for r in restarts if r["time_to_recover_s"] is not None]
    breakdown = {p: quantiles([r["breakdown_s"][p] for r in restarts if r["breakdown_s"] and p in r["breakdown_s"]])
                 for p in RECOVERY_PARTS}
    rolled = [b["rolled_back"] for b in backs]
    computed = sum(1 for r in records if "loss" in r)
    return {
        "faults_scheduled": len(faults), "faults_fired": sum(did_fire),
        "restarts": sum(not w["preempted"] for w in windows),
        "preemptions": sum(w["preempted"] for w in windows), "launches": soak_run["launches"],
        "hangs": sum(e["kind"] == "hang" for e in events),
        "checkpoints_failed": sum(e["kind"] == "checkpoint_failed" for e in events),
        "checkpoints_skipped": sum(e["kind"] == "checkpoint_skipped" for e in events),
        "stragglers_named": sum(e["kind"] == "straggler" for e in events),
        "by_kind": dict(sorted(by_kind.items())),
        "steps_recomputed": {"total": computed - steps, "per_restart_max": max(rolled, default=0),
                             "per_restart_mean": round(statistics.mean(rolled), 2) if rolled else 0,
                             "save_interval": every,
                             "restarts_over_one_interval": sum(r > every for r in rolled),
                             "each_resumed_newest_possible": all(b["newest_possible"] for b in backs)},
        "time_to_recover_s": quantiles(recover), "recovery_breakdown_s": breakdown,
        "time_to_recover_less_backoff_s": quantiles([r["breakdown_s"]["first_step_done"] - r["breakdown_s"]["backoff"]
                                                     for r in restarts if r["breakdown_s"]
                                                     and {"first_step_done", "backoff"} <= set(r["breakdown_s"])]),
        "losses_equal_uninterrupted": final == base,
        "max_rel_loss_diff": max((abs(final.get(k, float("nan")) - base[k]) / abs(base[k]) for k in base),
                                 default=None),
        "goodput": goodput(soak_run, records, events, steps),
        "goodput_model": modelled_goodput(soak_run, records, events, every),
        "goodput_uninterrupted": goodput(base_run, base_records, [], steps),
        "restart_log": [{**r, **b} for r, b in zip(restarts, backs)],
    }


def print_summary(result: dict) -> None:
    print(f"{'kind':18s} {'sched':>5s} {'fired':>5s} {'restarts':>8s} {'recover med s':>13s} {'p90 s':>6s}")
    for kind, k in result["by_kind"].items():
        r = k["recover_s"]
        print(f"{kind:18s} {k['scheduled']:5d} {k['fired']:5d} {k['restarts']:8d} {r.get('median', '-'):>13} "
              f"{r.get('p90', '-'):>6}")
    for key in ("faults_scheduled", "faults_fired", "restarts", "preemptions", "hangs", "checkpoints_failed",
                "checkpoints_skipped", "steps_recomputed", "time_to_recover_s", "time_to_recover_less_backoff_s",
                "recovery_breakdown_s",
                "losses_equal_uninterrupted", "max_rel_loss_diff", "wall_s"):
        print(f"{key:28s} {result[key]}")
    g, g0 = result["goodput"], result["goodput_uninterrupted"]
    print(f"{'goodput':28s} {g['goodput']:.3f} (uninterrupted {g0['goodput']:.3f}); seconds {g['seconds']}")


def main(argv: list[str] | None = None, launch=None) -> int:
    """``launch(args, env) -> exit code`` runs ``toolkit ARGS``; default: a subprocess, output in
    ``RUN_DIR.log`` (a test runs it in its own process)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="deepspeed")
    p.add_argument("--faults", type=int, default=4)
    p.add_argument("--steps", type=int, help="training steps (default: max(24, 4 x faults))")
    p.add_argument("--every", type=int, default=4, help="checkpoint.every")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", help="comma-separated fault kinds to draw from (default: every kind the job survives)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for both runs (repeatable)")
    p.add_argument("--work-dir", help="parent of the run directories (default: a temporary one, removed)")
    p.add_argument("--out", help="result JSON (default benchmarks/results/soak_<backend>.json)")
    p.add_argument("--at-scale", action="store_true",
                   help="only model the goodput of two larger jobs (benchmarks/results/goodput_at_scale.json)")
    args = p.parse_args(argv)
    if args.at_scale:
        result = at_scale()
        out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / "goodput_at_scale.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0
    steps = args.steps or max(24, 4 * args.faults)
    sets = job_sets(args.backend, steps, args.every, args.sets)
    eval_every = int(setting(sets, "train.eval_every", "0"))
    mix = fault_mix(sets, args.nproc)
    if args.kinds:
        chosen = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        if unknown := [k for k in chosen if k not in mix]:
            p.error(f"--kinds {','.join(unknown)}: not in this job's mix {','.join(mix)} (left out: {LEFT_OUT})")
        mix = chosen
    faults = schedule(args.faults, steps, args.every, eval_every or steps, args.nproc, mix,
                      random.Random(args.seed))
    if not eval_every:
        faults = [f for f in faults if f["kind"] != "slow_eval"]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    base_dir, soak_dir = work / f"{args.backend}-base", work / f"{args.backend}-soak"
    for d in (base_dir, soak_dir):
        shutil.rmtree(d, ignore_errors=True)
        Path(f"{d}.log").unlink(missing_ok=True)
    print(f"soak: {args.backend}, {len(faults)} faults over {steps} steps: {spec(faults)}", flush=True)
    if launch is None:  # a subprocess per command (a caller's own launch keeps its environment's ops)
        def launch(targs, env):
            return run_toolkit(targs, env, Path(f"{targs[targs.index('--run-dir') + 1]}.log"))
        if "TORCH_EXTENSIONS_DIR" not in os.environ:
            private_op_folder(work)
    prepare_data(work / "data-check", sets, args.nproc, launch)
    base_run = train(base_dir, sets, args.nproc, "", 0, launch)
    soak_run = train(soak_dir, sets, args.nproc, spec(faults), len(faults) + 10, launch)
    async_save = setting(sets, "checkpoint.async_save", "false").lower() == "true"
    result = {"backend": args.backend, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(soak_run["end"])),
              "faults": spec(faults), "kinds_in_mix": list(mix), "left_out": LEFT_OUT,
              "steps": steps, "save_every": args.every, "sets": sets,
              "wall_s": {"uninterrupted": round(base_run["end"] - base_run["start"], 1),
                         "with_faults": round(soak_run["end"] - soak_run["start"], 1)},
              **summarize(soak_dir, base_dir, soak_run, base_run, faults, steps, args.every, async_save),
              "command": " ".join(["python", "benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": platform.platform(), "cpus": os.cpu_count(),
              "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]}
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"soak_{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"soak: result in {out}; run directories in {work}", flush=True)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    ok = result["losses_equal_uninterrupted"] and result["steps_recomputed"]["each_resumed_newest_possible"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
