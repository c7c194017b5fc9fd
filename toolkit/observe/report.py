"""``toolkit report RUN_DIR``: a run as pictures and a short summary.

Reads ``metrics.jsonl`` (one record per optimizer step, eval records, resume events) and
``events.jsonl`` (failures, restarts, preemptions) and writes into ``RUN_DIR/report/``:
``loss.png`` (train and eval loss by step, resumes marked), ``lr.png``, ``grad_norm.png``,
``throughput.png`` (tokens/s over wall-clock time, failures and restarts marked), packing
efficiency and documents per row in the summary, for mixture-of-
experts runs ``experts.png`` (load-balancing loss, and per layer the busiest and idlest expert's
tokens relative to an even share, by step), and ``report.md``.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from toolkit.config import ConfigError
from toolkit.observe.metrics import METRICS_FILE
from toolkit.watch.events import read_events

# Events drawn on the time axis, with their colour; others are only counted in the summary.
MARKED = {"failure": "tab:red", "hang": "tab:red", "divergence": "tab:red", "preempted": "tab:orange",
          "preempt_saved": "tab:orange", "restart": "tab:purple", "recovered": "tab:green", "gave_up": "black"}


@dataclass
class Run:
    steps: dict[int, dict] = field(default_factory=dict)  # newest record per step (a resumed run appends)
    timeline: list[dict] = field(default_factory=list)  # every step record, also those redone after a restart
    evals: dict[int, float] = field(default_factory=dict)
    resumes: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    packing: dict = field(default_factory=dict)  # the trainer's "packing" record: how rows were made

    @property
    def start(self) -> float:
        """Wall-clock start: a step's record is written when the step ends, step_s after it began."""
        times = [r["time"] - r.get("step_s", 0) for r in self.steps.values()] + [e["time"] for e in self.events]
        return min(times)


def read_run(run_dir: Path) -> Run:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no {METRICS_FILE}: give a run directory written by toolkit train "
                          "(its --run-dir, default runs/demo)")
    run = Run(events=read_events(run_dir))
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill -9 mid-write; the rest of the file is still good
        if "loss" in r:
            run.steps[r["step"]] = r
            run.timeline.append(r)
        elif "eval_loss" in r:
            run.evals[r["step"]] = r["eval_loss"]
        elif r.get("event") == "resume":
            run.resumes.append(r)
        elif r.get("event") == "packing":
            run.packing = r
    if not run.steps:
        raise ConfigError(f"{path} holds no training step yet; run toolkit report once the first step is logged")
    if (run_dir / "config.yaml").is_file():
        run.config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    return run


def cmd_report(args) -> int:
    """``toolkit report RUN_DIR [--out DIR]``."""
    out = write_report(args.run_dir, args.out)
    print(f"toolkit: report written to {out}/report.md ({', '.join(sorted(p.name for p in out.glob('*.png')))})")
    return 0


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the PNGs and report.md; returns the report directory."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on training nodes
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = [_plot_loss(run, out), _plot_series(run, out, "lr", "learning rate"),
              _plot_series(run, out, "grad_norm", "gradient norm (before clipping)"), _plot_throughput(run, out)]
    if _expert_steps(run):
        images.append(_plot_experts(run, out))
    (out / "report.md").write_text(summary(run, run_dir, [p.name for p in images]))
    return out


# --- plots ------------------------------------------------------------------------------------------

def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_loss(run: Run, out: Path) -> Path:
    fig, ax = _figure("loss", "step", "loss (mean over valid tokens)")
    steps = sorted(run.steps)
    ax.plot(steps, [run.steps[s]["loss"] for s in steps], lw=1, label="train")
    if run.evals:
        ev = sorted(run.evals)
        ax.plot(ev, [run.evals[s] for s in ev], "o-", ms=4, label="eval")
    failed = sorted({e["step"] for e in run.events if e["kind"] == "failure" and e.get("step") is not None})
    for i, step in enumerate(failed):  # steps between the resume and here were computed twice
        ax.axvline(step, color="tab:red", ls=":", lw=1, label="failed" if i == 0 else None)
    for i, r in enumerate(run.resumes):  # where a restart picked the run up again
        ax.axvline(r["step"], color="tab:purple", ls="--", lw=1, label="resumed" if i == 0 else None)
    ax.legend()
    return _save(fig, out / "loss.png")


def _plot_series(run: Run, out: Path, key: str, label: str) -> Path:
    fig, ax = _figure(label, "step", label)
    steps = [s for s in sorted(run.steps) if run.steps[s].get(key) is not None]  # None: an fp16 skipped step
    ax.plot(steps, [run.steps[s][key] for s in steps], lw=1)
    return _save(fig, out / f"{key}.png")


def _plot_throughput(run: Run, out: Path) -> Path:
    fig, ax = _figure("throughput", "wall-clock minutes since start", "tokens / s")
    t0 = run.start
    records = sorted(run.timeline, key=lambda r: r["time"])
    minutes = [(r["time"] - t0) / 60 for r in records]
    ax.plot(minutes, [r["tokens_per_s"] for r in records], ".", ms=3, alpha=0.5, label="step")
    ax.plot(*_break_at_gaps(minutes, _rolling_median([r["tokens_per_s"] for r in records], 9)), lw=1.5,
            label="median of 9")
    for i, (down, up) in enumerate(_outages(run.events)):
        ax.axvspan((down - t0) / 60, (up - t0) / 60, color="tab:red", alpha=0.08, label="outage" if i == 0 else None)
    seen: set[str] = set()
    for e in run.events:
        if e["kind"] in MARKED:
            ax.axvline((e["time"] - t0) / 60, color=MARKED[e["kind"]], ls="--", lw=1,
                       label=e["kind"] if e["kind"] not in seen else None)
            seen.add(e["kind"])
    ax.legend(fontsize="small")
    return _save(fig, out / "throughput.png")


def _expert_steps(run: Run) -> list[int]:
    return [s for s in sorted(run.steps) if "moe_expert_tokens" in run.steps[s]]


def _layer_loads(record: dict) -> list[tuple[float, float]]:
    """Per MoE layer: the busiest and the idlest expert's tokens relative to an even load (1 = even).
    Experts are compared within a layer only: expert e of one layer is unrelated to expert e of another."""
    out = []
    for row in record["moe_expert_tokens"]:
        even = sum(row) / len(row)
        if even:
            out.append((max(row) / even, min(row) / even))
    return out


def _plot_experts(run: Run, out: Path) -> Path:
    import matplotlib.pyplot as plt
    steps = _expert_steps(run)
    fig, (aux, load) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True)
    aux.plot(steps, [run.steps[s]["moe_aux_loss"] for s in steps], lw=1)
    aux.set(title="mixture of experts", ylabel="load-balancing loss (k = even)")
    loads = [_layer_loads(run.steps[s]) for s in steps]
    for layer in range(len(loads[0])):
        line, = load.plot(steps, [ls[layer][0] for ls in loads], lw=1, label=f"layer {layer}")
        load.plot(steps, [ls[layer][1] for ls in loads], lw=1, ls="--", color=line.get_color())
    load.axhline(1.0, color="black", ls=":", lw=1, label="even")
    load.set(xlabel="step", ylabel="busiest (solid) and idlest (dashed)\nexpert's tokens / an even share")
    load.legend(fontsize="small", ncol=4)
    for ax in (aux, load):
        ax.grid(alpha=0.3)
    return _save(fig, out / "experts.png")


def _expert_lines(run: Run) -> list[str]:
    steps = _expert_steps(run)
    if not steps:
        return []
    first, last = run.steps[steps[0]], run.steps[steps[-1]]
    loads = _layer_loads(last)
    per_layer = ", ".join(f"{hi:.2f}x/{lo:.2f}x" for hi, lo in loads)
    return [f"- experts: load-balancing loss {first['moe_aux_loss']:.4f} -> {last['moe_aux_loss']:.4f}; busiest "
            f"expert at {max(run.steps[s]['moe_load_max'] for s in steps):.2f}x an even load (worst step); "
            f"busiest/idlest per layer at step {steps[-1]}: {per_layer}"]


def _outages(events: list[dict]) -> list[tuple[float, float]]:
    """(first failure, recovery) time pairs: the wall-clock time a restart cost."""
    spans, down = [], None
    for e in sorted(events, key=lambda e: e["time"]):
        if e["kind"] in ("failure", "hang", "divergence") and down is None:
            down = e["time"]
        elif e["kind"] == "recovered" and down is not None:
            spans.append((down, e["time"]))
            down = None
    return spans


def _break_at_gaps(minutes: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """A NaN where no step ran for much longer than usual (a restart), so no line bridges the outage."""
    if len(minutes) < 3:
        return minutes, values
    usual = statistics.median(b - a for a, b in zip(minutes, minutes[1:]))
    xs, ys = [minutes[0]], [values[0]]
    for i in range(1, len(minutes)):
        if minutes[i] - minutes[i - 1] > 10 * usual + 1 / 60:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(minutes[i])
        ys.append(values[i])
    return xs, ys


def _rolling_median(values: list[float], window: int) -> list[float]:
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


# --- summary -----------------------------------------------------------------------------------------

def summary(run: Run, run_dir: Path, images: list[str]) -> str:
    steps = sorted(run.steps)
    first, last = run.steps[steps[0]], run.steps[steps[-1]]
    planned = run.config.get("train", {}).get("steps")
    cfg = run.config
    lines = [f"# Run report: {run_dir}", ""]
    if cfg:
        m = cfg.get("megatron", {})
        layout = (f"ZeRO-{cfg['zero']['stage']}" if cfg.get("backend") == "deepspeed" else
                  f"tp={m['tp']} pp={m['pp']}" + (f" ep={m['ep']}" if m.get("ep", 1) > 1 else "")
                  + (f" cp={m['cp']}" if m.get("cp", 1) > 1 else ""))
        lines.append(f"- backend {cfg.get('backend')} ({layout}), {cfg.get('nproc')} rank(s) per node, "
                     f"model `{Path(cfg['model']['name_or_path']).name}` ({cfg['model']['dtype']})")
    lines += [f"- steps logged: {len(steps)} (last {steps[-1]}" + (f" of {planned})" if planned else ")"),
              f"- train loss: {first['loss']:.4f} (step {steps[0]}) -> {last['loss']:.4f} (step {steps[-1]})"]
    if run.evals:
        best = min(run.evals, key=run.evals.get)
        final = max(run.evals)
        lines.append(f"- eval loss: best {run.evals[best]:.4f} at step {best}; last {run.evals[final]:.4f} at step {final}")
    tps = [run.steps[s]["tokens_per_s"] for s in steps[1:]] or [first["tokens_per_s"]]
    step_s = [run.steps[s]["step_s"] for s in steps[1:]] or [first["step_s"]]
    wall = (max(r["time"] for r in run.steps.values()) - run.start) / 60
    lines.append(f"- throughput: median {statistics.median(tps):,.0f} tokens/s, median step {statistics.median(step_s):.3f} s "
                 f"(first step excluded); wall clock {wall:.1f} min")
    skipped = [s for s in steps if run.steps[s].get("skipped")]
    if skipped:
        lines.append(f"- fp16: {len(skipped)} step(s) skipped by the loss scaler (inf/nan gradients), first at step "
                     f"{skipped[0]}; loss scale at the end {last.get('loss_scale')}")
    lines += _packing_lines(run, steps)
    lines += _expert_lines(run)
    lines += _event_lines(run)
    lines += ["", *[f"![{Path(name).stem}]({name})" for name in images], ""]
    return "\n".join(lines)


def _packing_lines(run: Run, steps: list[int]) -> list[str]:
    """data.packing, the share of row tokens that are document tokens, documents per row (rows packed
    by documents or padded count them; ``concat`` rows are cut from one token stream and do not, so
    its line gives the documents and rows the packing made instead), overflow."""
    logged = [run.steps[s] for s in steps if "packing_efficiency" in run.steps[s]]
    if not logged:
        return []
    p = run.packing
    efficiency = statistics.mean(r["packing_efficiency"] for r in logged)
    line = (f"- packing {p.get('packing', '?')}: {100 * efficiency:.1f}% of row tokens are document tokens "
            "(packing efficiency)")
    counted = [r["documents_per_row"] for r in logged if "documents_per_row" in r]
    if counted:
        line += f", {statistics.mean(counted):.2f} documents per row"
    elif p.get("documents") is not None and p.get("train_rows") is not None:
        line += f", {p['documents']} documents concatenated into {p['train_rows']} rows"
    if p.get("overflow_documents"):
        line += f"; {p['overflow_documents']} documents longer than data.seq_len ({p['overflow']})"
    return [line]


def _breakdown_line(recovered: dict) -> str:
    """Where a recovery's time went: each stage's end in seconds since the failure was detected, in
    the order they happened (``restarted`` from the agent, the rest from the restarted rank 0)."""
    marks = sorted(recovered["breakdown_s"].items(), key=lambda kv: kv[1])
    return (f"  - recovery to step {recovered.get('step')}: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f} s"
            for k, v in marks) + " (since the failure was detected)")


def _event_lines(run: Run) -> list[str]:
    if not run.events and not run.resumes:
        return ["- no failures, restarts or preemptions"]
    counts: dict[str, int] = {}
    for e in run.events:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    lines = ["- events: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))] if counts else []
    recovered = [e["time_to_recover_s"] for e in run.events if e["kind"] == "recovered" and "time_to_recover_s" in e]
    if recovered:
        lines.append(f"- time to recover: {', '.join(f'{s:.1f} s' for s in recovered)}")
    lines += [_breakdown_line(e) for e in run.events if e["kind"] == "recovered" and e.get("breakdown_s")]
    if run.resumes:
        lines.append("- resumed at step(s): " + ", ".join(str(r["step"]) for r in run.resumes))
    return lines
