"""``toolkit`` command line: thin; each subcommand calls the library."""
from __future__ import annotations

import argparse
import sys

from toolkit.config import ConfigError, RunConfig, load_config
from toolkit.storage.space import path_error


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ConfigError, OSError) as exc:  # OSError: the filesystem refused a path (read-only, permission, full)
        if (message := str(exc) if isinstance(exc, ConfigError) else path_error(exc)) is None:
            raise
        print(f"toolkit: error: {message}", file=sys.stderr)
        return 2


class NodeRange(argparse.Action):
    """torchrun's ``--nnodes``: ``N``, or ``MIN:MAX`` for an elastic job. Sets ``nnodes`` (the most)
    and ``min_nnodes``."""

    def __call__(self, parser, namespace, value, option_string=None):
        low, _, high = str(value).partition(":")
        try:
            low_n, high_n = int(low), int(high or low)
        except ValueError:
            parser.error(f"{option_string} {value!r}: give a node count N or a range MIN:MAX, e.g. 1:4")
        if not 1 <= low_n <= high_n:
            parser.error(f"{option_string} {value!r}: need 1 <= MIN <= MAX")
        namespace.nnodes, namespace.min_nnodes = high_n, low_n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toolkit", description=__doc__)
    # The deepspeed launcher puts --local_rank=N right after the module name; LOCAL_RANK is in the env.
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="train or fine-tune (no CONFIG: the embedded demo)")
    t.add_argument("config", nargs="?", help="YAML run config (default: the embedded demo)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")
    t.add_argument("--run-dir", help="run directory (config key run_dir)")
    t.add_argument("--nproc", type=int, help="local ranks to start (config key nproc)")
    t.add_argument("--resume", choices=["auto", "never"], help="auto: continue from the newest complete checkpoint")
    t.add_argument("--nnodes", action=NodeRange, default=1,
                   help="nodes in the job (c10d rendezvous); MIN:MAX lets it continue on fewer nodes after a loss, "
                        "resharding the checkpoint to the new data-parallel size")
    t.add_argument("--node-rank", type=int, default=0)
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, for multi-node jobs")
    t.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    t.add_argument("--max-restarts", type=int, help="restart budget (config key restart.max_restarts)")
    t.add_argument("--profile", action="store_true",
                   help="trace a few steps with torch.profiler; RUN_DIR/profile/summary.md splits compute and collectives")
    t.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, DeepSpeed JSON or Megatron layout, and the estimate; start nothing")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("supervise", help="run any torchrun-style script under the restart policy")
    s.add_argument("--nproc", type=int, default=1)
    s.add_argument("--run-dir", default="runs/supervised", help="where events.jsonl and heartbeats go")
    s.add_argument("--max-restarts", type=int, default=3)
    s.add_argument("--backoff-s", type=float, default=1.0)
    s.add_argument("--hang-timeout-s", type=float, default=300.0,
                   help="restart when no rank beat for this long (the script calls toolkit.watch.heartbeat.beat)")
    s.add_argument("--nnodes", action=NodeRange, default=1, help="N, or MIN:MAX (elastic)")
    s.add_argument("--node-rank", type=int, default=0)
    s.add_argument("--rdzv-endpoint")
    s.add_argument("command_line", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    s.set_defaults(func=cmd_supervise)

    d = sub.add_parser("doctor", help="versions, devices, DeepSpeed ops; non-zero exit when something is wrong")
    d.set_defaults(func=lambda args: __import__("toolkit.observe.doctor", fromlist=["main"]).main())

    e = sub.add_parser("estimate", help="memory per rank, whether it fits, layouts that fit, step time; starts nothing")
    e.add_argument("config", nargs="?", help="YAML run config (default: the embedded demo)")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--device-memory", type=float, metavar="GiB", help="per device (default: GPU 0 here, else 80)")
    e.add_argument("--nodes", type=int, default=1)
    e.add_argument("--gpus-per-node", type=int, help="ranks per node (default: config key nproc)")
    e.add_argument("--cluster", action="append", default=[], metavar="KEY=VALUE",
                   help="intra_gbps, inter_gbps, intra_latency_us, inter_latency_us, peak_tflops, mfu")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.add_argument("--ep", type=int, metavar="N", help="mixture of experts: ep of the ZeRO EP and megatron EP rows")
    e.set_defaults(func=cmd_estimate)

    r = sub.add_parser("report", help="PNG plots (loss, LR, grad norm, tokens/s, restarts) and a markdown summary of a run")
    r.add_argument("run_dir", help="a run directory written by toolkit train")
    r.add_argument("--out", help="where to write (default: RUN_DIR/report)")
    r.set_defaults(func=lambda args: __import__("toolkit.observe.report", fromlist=["x"]).cmd_report(args))
    _add_convert_parsers(sub)
    return p


def _add_convert_parsers(sub) -> None:
    """``convert`` and ``inspect`` (implemented in toolkit/convert/commands.py; formats from its table)."""
    from toolkit.formats.table import SOURCES_HELP, TARGETS
    c = sub.add_parser("convert", help="convert a checkpoint between HF, DeepSpeed ZeRO and Megatron at any layout")
    c.add_argument("src", help=SOURCES_HELP)
    c.add_argument("dst", help="output directory (must not exist; written staged, then renamed)")
    c.add_argument("--to", choices=TARGETS,
                   help="default: hf (zero for an HF source); dcp: a PyTorch distributed checkpoint of an FSDP2 "
                        "model (HF names, AdamW state); accelerate: an HF Trainer / accelerate FSDP2 checkpoint-N/; "
                        "a LoRA checkpoint or HF-PEFT directory: hf (merged onto its base) or peft (the adapter)")
    c.add_argument("--tp", type=int, default=1, help="megatron tensor parallel size")
    c.add_argument("--pp", type=int, default=1, help="megatron pipeline parallel size")
    c.add_argument("--ep", type=int, default=1, help="expert parallel size: megatron's, or --to zero's zero.ep")
    c.add_argument("--dp", type=int, default=None,
                   help="data parallel size the output is described for (default: --ep for megatron, else 1)")
    c.add_argument("--zero-stage", type=int, default=2, help="ZeRO stage the output is described for")
    c.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="weights dtype (default: as stored)")
    c.add_argument("--vocab-divisor", type=int, metavar="N",
                   help="--to megatron: the vocabulary is padded to a multiple of N x tp, as the run's "
                        "megatron.make_vocab_size_divisible_by (default: a megatron source's recorded one, else 128)")
    c.add_argument("--weights-only", action="store_true", help="drop optimizer state (Adam restarts)")
    c.add_argument("--verify", action="store_true", help="check tensors and logits of SRC vs DST; exit 1 on mismatch")
    c.add_argument("--hf-config", help="config.json (or its dir) when none lies beside SRC")
    c.add_argument("--base", help="LoRA sources: the HF model directory the adapter was trained on (default: "
                                  "adapter_config.json's base_model_name_or_path, or the checkpoint's meta.json)")
    c.add_argument("--progress", action="store_true", help="progress bar even when stderr is not a terminal")
    c.set_defaults(func=lambda args: __import__("toolkit.convert.commands", fromlist=["x"]).cmd_convert(args))
    i = sub.add_parser("inspect", help="a checkpoint's format, layout, step, completeness; a data PREFIX's documents")
    i.add_argument("path", help=SOURCES_HELP)
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--hf-config", help="config.json (or its dir) when none lies beside PATH")
    i.set_defaults(func=lambda args: __import__("toolkit.convert.commands", fromlist=["x"]).cmd_inspect(args))
    pr = sub.add_parser("prepare", help="tokenize data.path into a Megatron indexed dataset PREFIX.bin/.idx, streamed")
    pr.add_argument("config", nargs="?", help="YAML run config: data.path, data.template, data.num_proc, the tokenizer")
    pr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pr.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin/.idx/.json (+ PREFIX_loss.*)")
    pr.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX")
    pr.set_defaults(func=lambda args: __import__("toolkit.data.prepare", fromlist=["x"]).cmd_prepare(args))


def _config_from_args(args) -> RunConfig:
    overrides = list(args.overrides)
    if getattr(args, "profile", False):
        overrides.append("profile.enabled=true")
    for key, value in (("run_dir", args.run_dir), ("nproc", args.nproc), ("resume", args.resume),
                       ("restart.max_restarts", args.max_restarts)):
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(args.config, overrides)


def cmd_train(args) -> int:
    from toolkit.run import train
    return train(_config_from_args(args), **_nodes(args), dry_run=args.dry_run)


def cmd_estimate(args) -> int:
    """Exit 0 when the layout fits the device memory, 3 when it does not."""
    from toolkit.estimate.run import parse_cluster, run_estimate
    from toolkit.plan import build_plan
    cfg = load_config(args.config, args.overrides)
    cluster = parse_cluster(args.nodes, args.gpus_per_node or cfg.nproc, args.cluster)
    return run_estimate(build_plan(cfg, [cluster.world]), cluster, args.device_memory, args.json, args.ep)


def cmd_supervise(args) -> int:
    from toolkit.run import supervise
    return supervise(args.command_line, nproc=args.nproc, run_dir=args.run_dir, **_nodes(args),
                     max_restarts=args.max_restarts, backoff_s=args.backoff_s, hang_timeout_s=args.hang_timeout_s)


def _nodes(args) -> dict:
    """``--nnodes`` (N or MIN:MAX), ``--node-rank``, ``--rdzv-endpoint`` as the launch's keywords."""
    return {"nnodes": args.nnodes, "min_nnodes": getattr(args, "min_nnodes", None), "node_rank": args.node_rank,
            "rdzv_endpoint": args.rdzv_endpoint}


if __name__ == "__main__":
    sys.exit(main())
