"""Training step cost: the toolkit's loop vs hand-written loops and HF Trainer, as ratios (issue #7).

Cases (2 ranks each, same Llama config, same seed, same packed demo-corpus samples, same batch):
  toolkit_ds     python -m toolkit train --nproc 2 (ZeRO-2, DeepSpeed path)
  raw_ds         a minimal DeepSpeed loop: deepspeed.initialize + forward / backward / step
                 (same ZeRO-2 JSON, same AdamW param groups, same micro-batch and accumulation)
  hf_trainer     transformers.Trainer with TrainingArguments(deepspeed=ds_configs/zero2.json)
  toolkit_mcore  python -m toolkit train --nproc 2 --set backend=megatron --set megatron.tp=2
  raw_mcore      a minimal megatron-core loop: GPTModel (local spec), TP=2, megatron DDP + distributed
                 optimizer (the stack the toolkit uses), get_forward_backward_func. megatron-core needs
                 CUDA; on a CPU machine this loop enables toolkit.compat.megatron_cpu exactly as the
                 toolkit's adapter does (it is what lets megatron-core run on CPU at all).
The baselines are started by torchrun (``python -m torch.distributed.run --standalone``), the toolkit
by its own launcher (torch's elastic agent); OMP_NUM_THREADS=1 in every case (2 ranks, 2 cores).

How a step is timed, identically everywhere: on rank 0, a ``time.perf_counter()`` stamp right after
optimizer step k has finished (after the loss of the step is known on the host); the step time is
the interval between consecutive stamps, so it includes everything a loop does between two optimizer
steps (data, logging, health checks). Toolkit: ``elapsed_s`` of ``metrics.jsonl`` (stamped when
the step's record is logged, right after ``engine.train_step`` returns). Baselines: the same stamp
in the loop; HF Trainer: a ``TrainerCallback.on_step_end``. The ranks are synchronized at each step
by the optimizer's collectives (ZeRO-2's all-gather, TP all-reduces). A run's figure is the median of
its intervals after ``--warmup`` steps; a case's figure the median over all its runs' intervals.
Cases run interleaved (round r runs every case, alternately forward and backward: ABBA...) so load
drift cancels in the ratios. Launch to first step: wall time from the parent's ``Popen`` to the
end of optimizer step 1 on rank 0. Peak RSS per rank: VmHWM of each rank process, polled every
0.1 s from the parent (VmHWM is a high-water mark, so polling misses only the last 0.1 s of a run).

  python benchmarks/step_overhead.py              # ~9 min on 2 cores (3 rounds x 5 cases x 30 steps)
  python benchmarks/step_overhead.py --quick      # ~2 min smoke (1 round, 10 steps)
  python benchmarks/step_overhead.py --cases lora --out benchmarks/results/lora_step.json   # LoRA vs full
Writes benchmarks/results/step_overhead.json (or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "step_overhead.json"

MODEL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=2048, hidden_size=256,
             intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
             initializer_range=0.02, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
             bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="float32")
TRAIN = dict(seq_len=128, global_batch_size=16, micro_batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=5,
             weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, grad_clip=1.0, seed=1234, log_every=10)
CASES = ["toolkit_ds", "raw_ds", "hf_trainer", "toolkit_mcore", "raw_mcore"]
LORA_CASES = ["toolkit_ds", "toolkit_lora", "hf_trainer", "hf_trainer_lora"]
"""``--cases lora``: LoRA (rank 16, alpha 32, every linear layer but the LM head) vs full fine-tuning,
the toolkit's and HF Trainer's + peft's, both on DeepSpeed ZeRO-2 (issue #20)."""
LORA = dict(rank=16, alpha=32.0)
RATIOS = [("toolkit_ds", "raw_ds", 1.03), ("toolkit_ds", "hf_trainer", 1.0), ("toolkit_mcore", "raw_mcore", 1.03),
          ("toolkit_lora", "hf_trainer_lora", 1.0), ("toolkit_lora", "toolkit_ds", None)]
DS_ZERO2 = json.loads((REPO / "ds_configs" / "zero2.json").read_text())


def _toolkit_sets(workdir: Path, steps: int) -> list[str]:
    t = TRAIN
    return [f"model.name_or_path={workdir / 'model'}", f"data.cache_dir={workdir / 'data_cache'}",
            f"data.seq_len={t['seq_len']}", f"train.steps={steps}", f"train.global_batch_size={t['global_batch_size']}",
            f"train.micro_batch_size={t['micro_batch_size']}", f"train.lr={t['lr']}", f"train.min_lr={t['min_lr']}",
            f"train.warmup_steps={t['warmup_steps']}", f"train.weight_decay={t['weight_decay']}",
            f"train.adam_beta1={t['betas'][0]}", f"train.adam_beta2={t['betas'][1]}", f"train.adam_eps={t['eps']}",
            f"train.grad_clip={t['grad_clip']}", f"train.seed={t['seed']}", f"train.log_every={t['log_every']}",
            "train.eval_every=0", "checkpoint.every=100000"]


# --- parent: data, cases, sampling ---------------------------------------------------------------------

def prepare(workdir: Path, steps: int) -> Path:
    """The model config, and the packed samples + per-step global batch order every case uses."""
    import torch

    from toolkit.config import load_config
    from toolkit.data import global_batch_indices, load_tokenizer, prepare_data
    (workdir / "model").mkdir(parents=True, exist_ok=True)
    (workdir / "model" / "config.json").write_text(json.dumps(MODEL, indent=2))
    cfg = load_config(None, _toolkit_sets(workdir, steps))
    data = prepare_data(cfg, load_tokenizer(cfg))  # fills the cache the toolkit runs then read
    ds = data.train.with_format("numpy", columns=["input_ids", "labels"])[:]
    gbs = TRAIN["global_batch_size"]
    order = [global_batch_indices(len(data.train), gbs, TRAIN["seed"], s) for s in range(steps)]
    path = workdir / "data.pt"
    torch.save({"input_ids": torch.from_numpy(ds["input_ids"]).long(), "labels": torch.from_numpy(ds["labels"]).long(),
                "order": torch.tensor(order, dtype=torch.long)}, path)
    return path


def _free_port() -> int:
    from toolkit.parallel import free_port  # the benchmark's parent imports no toolkit at module load
    return free_port()


def case_command(case: str, workdir: Path, run_dir: Path, steps: int) -> list[str]:
    if case.startswith("toolkit"):
        cmd = [sys.executable, "-m", "toolkit", "train", "--run-dir", str(run_dir), "--nproc", "2", "--resume", "never"]
        sets = _toolkit_sets(workdir, steps) + (["backend=megatron", "megatron.tp=2"] if case == "toolkit_mcore" else [])
        sets += [f"lora.rank={LORA['rank']}", f"lora.alpha={LORA['alpha']}"] if case == "toolkit_lora" else []
        for s in sets:
            cmd += ["--set", s]
        return cmd
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{_free_port()}", str(Path(__file__).resolve()),
            "--worker", case, "--workdir", str(workdir), "--run-dir", str(run_dir), "--steps", str(steps)]


class RssSampler(threading.Thread):
    """Peak RSS (VmHWM) of the rank processes under ``root_pid``, polled. A rank is a process whose
    command line holds ``marker`` and none of whose children does: torchrun's ranks under the
    launcher, and the toolkit's ranks forked from its forkserver (which carries the marker too)."""

    def __init__(self, root_pid: int, marker: str):
        super().__init__(daemon=True)
        self.root, self.marker, self.peaks, self.stop = root_pid, marker, {}, threading.Event()
        self.parents: set[int] = set()
        self.first_rank_seen = None  # time.time() when a rank process first showed up

    def run(self):
        import psutil
        root = psutil.Process(self.root)
        while not self.stop.is_set():
            try:
                kids = root.children(recursive=True)
            except psutil.Error:
                break
            for p in kids:
                try:
                    if self.marker not in " ".join(p.cmdline()) or p.pid in self.parents:
                        continue
                    if any(self.marker in " ".join(c.cmdline()) for c in p.children()):
                        self.parents.add(p.pid)  # the forkserver: a leaf again once its ranks exit
                        self.peaks.pop(p.pid, None)
                        continue
                    status = Path(f"/proc/{p.pid}/status").read_text()
                except (psutil.Error, OSError):
                    continue
                if self.first_rank_seen is None:
                    self.first_rank_seen = time.time()
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), int(line.split()[1]) / 1024)
            self.stop.wait(0.1)


def run_case(case: str, workdir: Path, rnd: int, steps: int) -> dict:
    run_dir = workdir / "runs" / f"{case}_r{rnd}"
    if run_dir.exists():
        import shutil
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = case_command(case, workdir, run_dir, steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    log = open(run_dir.parent / f"{case}_r{rnd}.log", "w")
    launch = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    sampler = RssSampler(proc.pid, "toolkit.train.worker" if case.startswith("toolkit") else "--worker")
    sampler.start()
    rc = proc.wait()
    total = time.time() - launch
    sampler.stop.set()
    sampler.join()
    log.close()
    if rc != 0:
        tail = (run_dir.parent / f"{case}_r{rnd}.log").read_text()[-3000:]
        raise SystemExit(f"{case} round {rnd} exited {rc}:\n{tail}")
    if case.startswith("toolkit"):
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        recs = sorted((r for r in recs if "loss" in r), key=lambda r: r["step"])
        stamps, first_wall = [r["elapsed_s"] for r in recs], recs[0]["time"]
        losses = [r["loss"] for r in recs]
    else:
        out = json.loads((run_dir / "rank0.json").read_text())
        stamps, first_wall, losses = out["stamps"], out["first_step_wall"], out["losses"]
    if len(stamps) != steps:
        raise SystemExit(f"{case} round {rnd}: {len(stamps)} step stamps, expected {steps}")
    return {"case": case, "round": rnd, "stamps": stamps, "launch_to_first_step_s": round(first_wall - launch, 3),
            "launch_to_ranks_started_s": round(sampler.first_rank_seen - launch, 2) if sampler.first_rank_seen else None,
            "process_wall_s": round(total, 2), "peak_rss_mb_per_rank": sorted(round(v, 1) for v in sampler.peaks.values()),
            "first_loss": losses[0], "last_loss": losses[-1], "command": " ".join(cmd)}


def intervals(stamps: list[float], warmup: int) -> list[float]:
    """Step k's time = stamp k - stamp k-1, for steps after the warm-up."""
    return [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])] if warmup >= 1 else \
        [b - a for a, b in zip(stamps, stamps[1:])]


def summarize(runs: list[dict], cases: list[str], warmup: int) -> dict:
    out = {}
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        pooled = [d for r in mine for d in intervals(r["stamps"], warmup)]
        out[case] = {"median_step_s": round(statistics.median(pooled), 4),
                     "per_run_median_step_s": [round(statistics.median(intervals(r["stamps"], warmup)), 4) for r in mine],
                     "min_step_s": round(min(pooled), 4), "intervals": len(pooled),
                     "launch_to_first_step_s": round(statistics.median(r["launch_to_first_step_s"] for r in mine), 2),
                     "launch_to_ranks_started_s": round(statistics.median(r["launch_to_ranks_started_s"] or 0 for r in mine), 2),
                     "peak_rss_mb_per_rank": max((r["peak_rss_mb_per_rank"] for r in mine), key=lambda v: max(v or [0])),
                     "first_loss": mine[0]["first_loss"], "last_loss": mine[0]["last_loss"]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round of 10 steps (warm-up 3): a ~2 min smoke")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, or 'lora' for {','.join(LORA_CASES)}")
    p.add_argument("--workdir", default="/tmp/toolkit_bench_step_overhead")
    p.add_argument("--out", default=str(RESULT))
    p.add_argument("--worker", choices=["raw_ds", "hf_trainer", "hf_trainer_lora", "raw_mcore"], help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker, Path(a.workdir), Path(a.run_dir), a.steps)
    if a.quick:
        a.rounds, a.steps, a.warmup = 1, 10, 3
    cases = LORA_CASES if a.cases == "lora" else a.cases.split(",")
    workdir = Path(a.workdir)
    started = time.time()
    prepare(workdir, a.steps)
    runs = []
    for rnd in range(a.rounds):
        for case in (cases if rnd % 2 == 0 else cases[::-1]):  # ABBA: drift cancels in the ratios
            r = run_case(case, workdir, rnd, a.steps)
            med = statistics.median(intervals(r["stamps"], a.warmup))
            print(f"round {rnd} {case:14s} median step {med:.3f} s, first step after "
                  f"{r['launch_to_first_step_s']:.1f} s, process {r['process_wall_s']:.1f} s", flush=True)
            runs.append(r)
    figures = summarize(runs, cases, a.warmup)
    ratios = {}
    for ours, ref, target in RATIOS:
        if ours in figures and ref in figures:
            per_round = [round(statistics.median(intervals(x["stamps"], a.warmup)) /
                               statistics.median(intervals(y["stamps"], a.warmup)), 3)
                         for x in runs if x["case"] == ours for y in runs if y["case"] == ref and y["round"] == x["round"]]
            ratios[f"{ours}/{ref}"] = {"step_time_ratio": round(figures[ours]["median_step_s"]
                                                                / figures[ref]["median_step_s"], 3),
                                       "per_round": per_round, "target_max": target}
    result = {"benchmark": "step_overhead", "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "machine": _machine(), "versions": _versions(),
              "command": " ".join(["python", "benchmarks/step_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
              "settings": {"rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "model": MODEL, "train": TRAIN,
                           "zero_stage": 2, "megatron": {"tp": 2, "pp": 1, "dp": 1}, "ranks": 2, "OMP_NUM_THREADS": 1},
              "figures": figures, "ratios": ratios, "total_wall_s": round(time.time() - started, 1),
              "runs": [{k: v for k, v in r.items()} for r in runs]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result, a.out)
    return 0


def print_table(result: dict, out: str) -> None:
    f = result["figures"]
    print("\n| case | median step s | per-run medians | first step after launch s (ranks started) | peak RSS MB per rank |")
    print("|---|---|---|---|---|")
    for case, x in f.items():
        print(f"| {case} | {x['median_step_s']:.3f} | {', '.join(f'{v:.3f}' for v in x['per_run_median_step_s'])} | "
              f"{x['launch_to_first_step_s']:.1f} ({x['launch_to_ranks_started_s']:.1f}) | "
              f"{', '.join(f'{v:.0f}' for v in x['peak_rss_mb_per_rank'])} |")
    print("\n| ratio | step time | per round | target |")
    print("|---|---|---|---|")
    for name, r in result["ratios"].items():
        target = r["target_max"]
        verdict = "-" if target is None else f"<= {target} ({'met' if r['step_time_ratio'] <= target else 'NOT met'})"
        print(f"| {name} | {r['step_time_ratio']:.3f} | {', '.join(map(str, r['per_round']))} | {verdict} |")
    print(f"\ntotal {result['total_wall_s']:.0f} s; written to {out}")


def _machine() -> dict:
    load = os.getloadavg()
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "loadavg_at_end": [round(x, 2) for x in load]}


def _versions() -> dict:
    from importlib.metadata import version
    return {name: version(name) for name in ("torch", "deepspeed", "transformers", "megatron-core", "accelerate")}


# --- workers (one per rank, started by torchrun) ----------------------------------------------------

class Stamps:
    """Rank 0's end-of-step stamps, written to RUN_DIR/rank0.json at the end."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank, self.stamps, self.losses, self.first_wall = run_dir, rank, [], [], None

    def step_done(self, loss: float) -> None:
        self.stamps.append(time.perf_counter())
        if self.first_wall is None:
            self.first_wall = time.time()
        self.losses.append(loss)

    def save(self) -> None:
        if self.rank == 0:
            (self.run_dir / "rank0.json").write_text(json.dumps(
                {"stamps": self.stamps, "first_step_wall": self.first_wall, "losses": self.losses}))


def _lr(step: int, steps: int) -> float:
    import math
    t = TRAIN
    if step < t["warmup_steps"]:
        return t["lr"] * (step + 1) / t["warmup_steps"]
    frac = (step - t["warmup_steps"]) / max(1, steps - t["warmup_steps"])
    return t["min_lr"] + 0.5 * (t["lr"] - t["min_lr"]) * (1 + math.cos(math.pi * min(frac, 1.0)))


def worker(case: str, workdir: Path, run_dir: Path, steps: int) -> int:
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    data = torch.load(workdir / "data.pt")
    stamps = Stamps(run_dir, rank)
    {"raw_ds": raw_deepspeed, "hf_trainer": hf_trainer, "raw_mcore": raw_megatron,
     "hf_trainer_lora": lambda *a: hf_trainer(*a, lora=True)}[case](workdir, data, steps, stamps)
    stamps.save()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _hf_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(TRAIN["seed"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL), dtype=torch.float32)
    model.config.use_cache = False
    return model


def raw_deepspeed(workdir: Path, data: dict, steps: int, stamps: Stamps) -> None:
    """The loop a DeepSpeed user writes: one engine, micro-batches, backward, step."""
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = TRAIN
    model = _hf_model()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    config = {"train_batch_size": t["global_batch_size"], "train_micro_batch_size_per_gpu": t["micro_batch_size"],
              "gradient_accumulation_steps": t["global_batch_size"] // (t["micro_batch_size"] * world),
              "gradient_clipping": t["grad_clip"], "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": t["lr"], "betas": list(t["betas"]), "eps": t["eps"],
                                                        "weight_decay": t["weight_decay"]}},
              "zero_optimization": DS_ZERO2["zero_optimization"]}
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, config=config, model_parameters=[{"params": decay, "weight_decay": t["weight_decay"]},
                                                      {"params": no_decay, "weight_decay": 0.0}])
    per_rank, mbs = t["global_batch_size"] // world, t["micro_batch_size"]
    for step in range(steps):
        for g in optimizer.param_groups:
            g["lr"] = _lr(step, steps)
        idx = data["order"][step][rank * per_rank:(rank + 1) * per_rank]
        ids, labels = data["input_ids"][idx], data["labels"][idx]
        total = 0.0
        for i in range(0, per_rank, mbs):
            logits = engine(input_ids=ids[i:i + mbs]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[i:i + mbs].flatten(), ignore_index=-100)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        stamps.step_done(total / (per_rank // mbs))


def hf_trainer(workdir: Path, data: dict, steps: int, stamps: Stamps, lora: bool = False) -> None:
    """transformers.Trainer with its DeepSpeed integration, the ZeRO-2 JSON the toolkit ships; with
    ``lora``, the model wrapped by peft first (``get_peft_model``), as a Trainer + peft user does."""
    import torch
    import torch.nn.functional as F
    from transformers import Trainer, TrainerCallback, TrainingArguments
    t = TRAIN

    class Packed(torch.utils.data.Dataset):  # the same packed samples (labels already shifted)
        def __len__(self):
            return len(data["input_ids"])

        def __getitem__(self, i):
            return {"input_ids": data["input_ids"][i], "labels": data["labels"][i]}

    def loss_func(outputs, labels, num_items_in_batch=None):  # labels are pre-shifted: no second shift
        logits = outputs.logits.float().flatten(0, 1)
        loss = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")
        return loss / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum())

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.step_done(float("nan"))

    # accelerate finds no distributed backend on a CPU-only machine when DeepSpeed is on (its state
    # gets backend None, i.e. 1 process, and ddp_backend is ignored with deepspeed=...): create its
    # state first with gloo, as `accelerate launch` with a DeepSpeed config would, and let the
    # Trainer use it. On a GPU machine none of this is needed.
    from accelerate import PartialState
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    world = int(os.environ["WORLD_SIZE"])
    args = TrainingArguments(
        output_dir=str(workdir / "hf_out"), max_steps=steps, per_device_train_batch_size=t["micro_batch_size"],
        gradient_accumulation_steps=t["global_batch_size"] // (t["micro_batch_size"] * world),
        learning_rate=t["lr"], weight_decay=t["weight_decay"], adam_beta1=t["betas"][0], adam_beta2=t["betas"][1],
        adam_epsilon=t["eps"], max_grad_norm=t["grad_clip"], lr_scheduler_type="cosine", warmup_steps=t["warmup_steps"],
        logging_steps=t["log_every"], save_strategy="no", eval_strategy="no", report_to="none", seed=t["seed"],
        data_seed=t["seed"], dataloader_num_workers=0, accelerator_config={"use_configured_state": True},
        deepspeed=json.loads(json.dumps(DS_ZERO2)))
    model = _hf_model()
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                                 target_modules="all-linear"))
    trainer = Trainer(model=model, args=args, train_dataset=Packed(), compute_loss_func=loss_func,
                      callbacks=[Stamp()])
    trainer.train()


def raw_megatron(workdir: Path, data: dict, steps: int, stamps: Stamps) -> None:
    """The loop a megatron-core user writes (Megatron-LM's pretrain_gpt stack, no toolkit code except
    the CPU compat layer): GPTModel + local spec, DDP, distributed optimizer, forward_backward_func."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    if not torch.cuda.is_available():
        from toolkit.compat import megatron_cpu  # megatron-core on CPU at all (as the toolkit's adapter)
        megatron_cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, vocab_parallel_cross_entropy
    from megatron.core.transformer import TransformerConfig
    dist.init_process_group("gloo")
    t, m, tp = TRAIN, MODEL, 2
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(t["seed"])
    torch.manual_seed(t["seed"])
    config = TransformerConfig(
        num_layers=m["num_hidden_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_key_value_heads"], ffn_hidden_size=m["intermediate_size"],
        kv_channels=m["hidden_size"] // m["num_attention_heads"], normalization="RMSNorm", layernorm_epsilon=m["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=m["initializer_range"], tensor_model_parallel_size=tp, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True)
    gpt = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=m["vocab_size"],
                   max_sequence_length=m["max_position_embeddings"], position_embedding_type="rope",
                   rotary_base=int(m["rope_theta"]), share_embeddings_and_output_weights=False)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True), gpt)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t["lr"], weight_decay=t["weight_decay"], adam_beta1=t["betas"][0], adam_beta2=t["betas"][1],
        adam_eps=t["eps"], clip_grad=t["grad_clip"], use_distributed_optimizer=True, params_dtype=torch.float32), [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    mbs, seq = t["micro_batch_size"], t["seq_len"]
    positions = torch.arange(seq).unsqueeze(0).expand(mbs, seq)

    def loss_func(labels, logits):
        losses = vocab_parallel_cross_entropy(logits.float().contiguous(), labels.clamp(min=0))
        mask = (labels != -100).float()
        loss = (losses * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # megatron divides the loss in place

    def forward_step(it, model):
        ids, labels = next(it)
        from functools import partial
        return model(ids, positions, None), partial(loss_func, labels)

    forward_backward = get_forward_backward_func()
    for step in range(steps):  # dp = 1: every rank takes the whole global batch
        for g in optimizer.param_groups:
            g["lr"] = _lr(step, steps)
        idx = data["order"][step]
        ids, labels = data["input_ids"][idx], data["labels"][idx]
        micro = [(ids[i:i + mbs], labels[i:i + mbs]) for i in range(0, len(idx), mbs)]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                               num_microbatches=len(micro), seq_length=seq, micro_batch_size=mbs, forward_only=False)
        ok, _, _ = optimizer.step()
        stamps.step_done(sum(d["lm loss"].item() for d in out) / len(out))


if __name__ == "__main__":
    sys.exit(main())
