"""``toolkit estimate`` and ``toolkit train --dry-run``: a plan's memory per rank (``memory.py``),
the layouts that would fit, and its step time (``steptime.py``), printed or as JSON."""
from __future__ import annotations

from dataclasses import asdict

from toolkit.config import ConfigError, RunConfig, parse_yaml
from toolkit.estimate.memory import USABLE, GiB, fits, memory, suggestions
from toolkit.estimate.moe import moe_shape, zero_ep
from toolkit.estimate.steptime import Cluster, StepTime, step_time
from toolkit.layout import Layout
from toolkit.plan import Plan
from toolkit.plan.checks import check_layout
from toolkit.plan.model import ModelSpec

# --- the whole estimate -----------------------------------------------------------------------------

def estimate(plan: Plan, cluster: Cluster, device_gib: float, ep: int | None = None) -> dict:
    """Memory per rank, fit, smallest fitting layouts and step time at ``cluster``; JSON-able. For a
    mixture-of-experts model also ``moe``: ZeRO-3, ZeRO EP and megatron EP side by side at ``ep``
    (``moe_comparison``)."""
    cfg, spec, world = plan.config, plan.model, cluster.world
    lay = plan.layout(world)
    bucket = int(plan.ds_config(world).get("zero_optimization", {}).get("reduce_bucket_size", 0)) \
        if cfg.backend == "deepspeed" else None
    lora = plan.lora.trainable if plan.lora else None
    mem = memory(cfg, spec, lay, bucket, lora)
    trainable, _ = plan.trainable_parameters()
    return {
        "model": {"model_type": spec.model_type, "params": spec.total, "layers": spec.layers,
                  "hidden": spec.hidden, "vocab": spec.vocab, "tied": spec.tied, "trainable_params": trainable,
                  "vision": spec.vision, "projector": spec.projector, "lora": plan.lora is not None},
        "quantize": _quantize(cfg, spec, lay, bucket, lora, mem),
        "layout": lay.model_dump(), "layout_text": lay.describe(), "cluster": cluster.model_dump(),
        "memory": {**asdict(mem), "model_state": mem.model_state, "total": mem.total},
        "device_gib": device_gib, "fits": fits(mem, device_gib),
        "suggestions": [{"layout": fit.describe(), "total_gib": m.total / GiB}
                        for fit, m in suggestions(cfg, spec, world, device_gib, bucket, lora_trainable=lora)],
        "step": _step_dict(step_time(cfg, spec, lay, cluster)),
        "scaling": _scaling(cfg, spec, lay, cluster),
        "moe": moe_comparison(cfg, spec, cluster, ep) if moe_shape(spec) else None,
    }


# --- mixture of experts: which way to train them ------------------------------------------------------

def moe_comparison(cfg: RunConfig, spec: ModelSpec, cluster: Cluster, ep: int | None = None) -> dict:
    """ZeRO-3 with the experts gathered, ZeRO (the config's stage) with expert parallelism and megatron EP
    at ``cluster``'s world, each: layout, memory per rank, the experts' traffic per rank and step, step
    time (``estimate/moe.py``). ``ep``: ``--ep``, else ``zero.ep`` / ``megatron.ep`` where above 1, else the
    largest that divides both the experts and the world."""
    world, shape = cluster.world, moe_shape(spec)
    ep, source = _comparison_ep(cfg, shape.experts, world, ep)
    ds = cfg.model_copy(update={"backend": "deepspeed"})
    three = cfg.model_copy(update={"backend": "deepspeed", "zero": cfg.zero.model_copy(update={"stage": 3})})
    mcore = cfg.model_copy(update={"backend": "megatron", "megatron": cfg.megatron.model_copy(update={"ep": ep})})
    rows = [_moe_row("ZeRO-3, experts gathered", three, spec, cluster, 1),
            _moe_row(f"ZeRO-{cfg.zero.stage} EP={ep} (zero.ep)", ds, spec, cluster, ep),
            _moe_row(f"megatron EP={ep} ({cfg.megatron.moe_dispatcher})", mcore, spec, cluster, None)]
    return {"ep": ep, "ep_source": source, "rows": rows}


def _comparison_ep(cfg: RunConfig, experts: int, world: int, option: int | None) -> tuple[int, str]:
    valid = [e for e in range(1, min(experts, world) + 1) if experts % e == 0 and world % e == 0]
    if option is not None:
        if option not in valid:
            raise ConfigError(f"--ep={option}: expert parallelism splits {experts} experts over {world} ranks; choose "
                              f"ep in {valid}")
        return option, "--ep"
    if zero_ep(cfg) > 1:
        return zero_ep(cfg), "zero.ep"
    if cfg.megatron.ep > 1:
        return cfg.megatron.ep, "megatron.ep"
    return max(valid), "the largest dividing the experts and the world (--ep to choose)"


def _moe_row(name: str, cfg: RunConfig, spec: ModelSpec, cluster: Cluster, ep: int | None) -> dict:
    """One way of training the experts (``ep`` for the DeepSpeed rows; megatron reads its layout's)."""
    try:
        lay = check_layout(cfg, spec, cluster.world)
    except ConfigError as exc:
        return {"name": name, "error": str(exc)}
    mem = memory(cfg, spec, lay, ep=ep)
    step = step_time(cfg, spec, lay, cluster, ep=ep)
    return {"name": name, "layout": lay.describe(), "model_state": mem.model_state, "total": mem.total,
            "expert_bytes": expert_traffic(step, spec), "step_s": step.total_s, "comm_s": step.comm_s}


def expert_traffic(step: StepTime, spec: ModelSpec) -> float:
    """Bytes one rank sends per step for the experts: the token exchange and the experts' own
    collectives (groups ``ep``, ``expert-dp``); without them (ZeRO without EP) the experts' share of the
    ZeRO collectives of the whole model. A ring all-gather, reduce-scatter or all-to-all of n bytes over
    p ranks sends (p-1)/p·n from each rank, an all-reduce twice that."""
    def sent(c) -> float:
        return c.count * c.nbytes * (c.ranks - 1) / c.ranks * (2 if c.kind == "all-reduce" else 1)
    own = [c for c in step.collectives if c.group in ("ep", "expert-dp")]
    if own:
        return sum(sent(c) for c in own)
    return sum(sent(c) for c in step.collectives if c.group == "dp") * moe_shape(spec).params / spec.total


def _quantize(cfg: RunConfig, spec: ModelSpec, lay, bucket, lora, mem) -> dict | None:
    """A 4-bit base: how many weights it quantizes, and the weights' bytes without it (the saving)."""
    if cfg.model.quantize == "none":
        return None
    dense = cfg.model_copy(update={"model": cfg.model.model_copy(update={"quantize": "none"})})
    return {"type": cfg.model.quantize, "quantized_params": spec.quantized,
            "weights_unquantized": memory(dense, spec, lay, bucket, lora).weights, "weights": mem.weights}


def _step_dict(t: StepTime) -> dict:
    return {"compute_s": t.compute_s, "bubble_s": t.bubble_s, "comm_s": t.comm_s, "total_s": t.total_s,
            "comm_share": t.comm_share, "collectives": [asdict(c) for c in t.collectives]}


def _scaling(cfg: RunConfig, spec: ModelSpec, lay: Layout, cluster: Cluster) -> list[dict]:
    """Step time as nodes are added (DP grows, global batch fixed) while every DP rank has a micro-batch."""
    rows = []
    for nodes in (2**k for k in range(0, 11)):
        world = nodes * cluster.gpus_per_node
        if not lay.fits(world):
            continue
        grown = lay.at_world(world)
        if cfg.train.global_batch_size < cfg.train.micro_batch_size * grown.dp:
            break
        t = step_time(cfg, spec, grown, cluster.model_copy(update={"nodes": nodes}))
        rows.append({"nodes": nodes, "gpus": world, "step_s": t.total_s, "comm_share": t.comm_share})
    return rows


def print_estimate(result: dict) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table
    # Off a terminal rich assumes 80 columns and wraps the tables; logs and pipes can take more.
    console = Console(width=None if sys.stdout.isatty() else 120)
    mem, model = result["memory"], result["model"]
    console.print(f"model: {model['model_type']}, {model['params'] / 1e6:,.2f} M parameters, {model['layers']} layers, "
                  f"hidden {model['hidden']}, vocab {model['vocab']}{' (tied)' if model['tied'] else ''}")
    if model.get("vision"):  # a vision-language model: its tower and projector among the parameters
        console.print(f"vision tower {model['vision']:,} parameters, projector {model['projector']:,} (image tokens "
                      "are tokens of data.seq_len; the tower's activations and pixel values are counted at their bound, every "
                      "token an image token)")
    if model["trainable_params"] != model["params"]:  # LoRA: the base frozen, adapters trained
        what = "LoRA adapters; the base is frozen" if model.get("lora", True) else "the frozen vision tower has"
        console.print(f"trainable: {model['trainable_params']:,} parameters ({what}: no gradients or optimizer "
                      "state for it)")
    if result.get("quantize"):
        q = result["quantize"]
        console.print(f"weights {q['weights_unquantized'] / GiB:,.3f} GiB -> {q['weights'] / GiB:,.3f} GiB per rank with "
                      f"{q['type']}: {q['quantized_params']:,} of {model['params']:,} parameters quantized")
    c = result["cluster"]
    console.print(f"layout: {result['layout_text']} on {c['nodes']} node(s) x {c['gpus_per_node']} = "
                  f"{result['layout']['world']} ranks")
    table = Table("per rank (fullest)", "GiB", title="memory (formulas: toolkit/estimate/memory.py)")
    for key, label in (("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
                       ("buffers", "buffers"), ("activations_no_ckpt", "activations, no checkpointing"),
                       ("activations_ckpt", "activations, with checkpointing"), ("activations", "activations, as set"),
                       ("logits_loss", "  of which logits and loss"), ("total", "total"),
                       ("host", "host memory (offload)"), ("host_load", "host memory at load"),
                       ("host_export", "host memory at export (hf_final/)")):
        table.add_row(label, f"{mem[key] / GiB:,.3f}")
    console.print(table)
    console.print(f"host memory at load / export: the rank's share of the weights plus its largest tensor "
                  f"({mem['largest_tensor']:,} elements), beyond the fixed runtime")
    verdict = "fits" if result["fits"] else "does NOT fit"
    console.print(f"{verdict} in {result['device_gib']:g} GiB per device ({USABLE:.0%} usable)")
    for s in result["suggestions"]:
        console.print(f"  fits: {s['layout']}  ({s['total_gib']:,.2f} GiB)")
    if not result["suggestions"]:
        console.print("  no layout of this backend fits at this world size: add devices, shorten data.seq_len, "
                      "or lower train.micro_batch_size")
    _print_step(console, result)
    if result.get("moe"):
        _print_moe(console, result["moe"])


def _print_moe(console, moe: dict) -> None:
    from rich.table import Table
    table = Table("experts trained with", "layout", "model state GiB", "total GiB", "experts' traffic / rank",
                  "step", title=f"mixture of experts: which to pick (ep={moe['ep']}: {moe['ep_source']}; "
                                "formulas: toolkit/estimate/moe.py)")
    for row in moe["rows"]:
        if "error" in row:
            table.add_row(row["name"], f"not possible here: {row['error']}", "", "", "", "")
            continue
        table.add_row(row["name"], row["layout"], f"{row['model_state'] / GiB:,.3f}", f"{row['total'] / GiB:,.3f}",
                      f"{row['expert_bytes'] / 2**20:,.2f} MiB", f"{_secs(row['step_s'])} ({_secs(row['comm_s'])} comm)")
    console.print(table)


def _print_step(console, result: dict) -> None:
    from rich.table import Table
    step = result["step"]
    table = Table("part", "count", "bytes each", "link", "seconds", title="step time (alpha-beta model, no overlap)")
    table.add_row("compute", "", "", "", _secs(step["compute_s"]))
    if step["bubble_s"]:
        table.add_row("pipeline bubble", "", "", "", _secs(step["bubble_s"]))
    for col in step["collectives"]:
        table.add_row(f"{col['kind']} ({col['group']}, {col['ranks']} ranks)", str(col["count"]),
                      f"{col['nbytes'] / 2**20:,.2f} MiB", "inter-node" if col["inter_node"] else "intra-node",
                      _secs(col["seconds"]))
    table.add_row("total", "", "", "", f"{_secs(step['total_s'])}  (communication {step['comm_share']:.0%})")
    console.print(table)
    console.print("scaling (DP grows, same global batch): " + ", ".join(
        f"{r['nodes']} node(s) {_secs(r['step_s'])} ({r['comm_share']:.0%} comm)" for r in result["scaling"]))


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


# --- entry points (toolkit estimate, toolkit train --dry-run) ---------------------------------------

def parse_cluster(nodes: int, gpus_per_node: int, items: list[str]) -> Cluster:
    """``--cluster key=value`` items on top of the node counts; errors name the key and the fix."""
    from pydantic import ValidationError
    raw: dict = {"nodes": nodes, "gpus_per_node": gpus_per_node}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in Cluster.model_fields:
            raise ConfigError(f"--cluster {item!r}: expected KEY=VALUE with KEY one of {', '.join(Cluster.model_fields)}")
        raw[key] = parse_yaml(value, f"--cluster {item!r}", line_numbers=False)
    try:
        return Cluster.model_validate(raw)
    except ValidationError as exc:
        errs = [f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("invalid cluster description: " + "; ".join(errs)) from None


def default_device_gib() -> tuple[float, str]:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB, "this machine's GPU 0"
    return 80.0, "assumed (no GPU here): pass --device-memory GiB"


def run_estimate(plan: Plan, cluster: Cluster, device_gib: float | None, as_json: bool, ep: int | None = None) -> int:
    import json
    source = "--device-memory"
    if device_gib is None:
        device_gib, source = default_device_gib()
    if device_gib <= 0:
        raise ConfigError(f"--device-memory={device_gib}: must be > 0 GiB, e.g. --device-memory 80")
    result = estimate(plan, cluster, device_gib, ep)
    result["device_source"] = source
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_estimate(result)
    return 0 if result["fits"] else 3


def dry_run(plan: Plan, nnodes: int, device_gib: float | None = None) -> int:
    """Print the plan a launch would write (RUN_DIR/plan.json), then the estimate; start no process
    (the caller has made the launch's checks, the data's included)."""
    import json

    import yaml
    cfg = plan.config
    world = cfg.nproc * nnodes
    print("# resolved run config (written to RUN_DIR/config.yaml; the ranks read RUN_DIR/plan.json)")
    print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
    print(f"# layout at {world} rank(s)\n{plan.layout(world).model_dump_json(indent=2)}")
    if cfg.backend == "deepspeed":
        print(f"# DeepSpeed config (RUN_DIR/ds_config.json)\n{json.dumps(plan.ds_config(world), indent=2)}")
    if plan.lora:
        print(f"# LoRA, resolved against the model's modules\n{plan.lora.model_dump_json(indent=2)}")
    print(f"# estimate: {world} rank(s) = {nnodes} node(s) x {cfg.nproc}")
    run_estimate(plan, Cluster(nodes=nnodes, gpus_per_node=cfg.nproc), device_gib, as_json=False)
    print("toolkit: dry run - no process group was started; config, data and machine checked as the run checks them")
    return 0
