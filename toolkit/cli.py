"""``toolkit`` command line: thin; each subcommand calls the library."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from toolkit.config import ConfigError, RunConfig, dump_config, load_config


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"toolkit: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toolkit", description=__doc__)
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="train or fine-tune (no CONFIG: the embedded demo)")
    t.add_argument("config", nargs="?", help="YAML run config (default: the embedded demo)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")
    t.add_argument("--run-dir", help="run directory (config key run_dir)")
    t.add_argument("--nproc", type=int, help="local ranks to start (config key nproc)")
    t.add_argument("--resume", choices=["auto", "never"], help="auto: continue from the newest complete checkpoint")
    t.add_argument("--nnodes", type=int, default=1, help="nodes in the job (c10d rendezvous)")
    t.add_argument("--node-rank", type=int, default=0)
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, for multi-node jobs")
    t.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    t.set_defaults(func=cmd_train)
    return p


def _config_from_args(args) -> RunConfig:
    overrides = list(args.overrides)
    for key, value in (("run_dir", args.run_dir), ("nproc", args.nproc), ("resume", args.resume)):
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(args.config, overrides)


def cmd_train(args) -> int:
    from toolkit.parallel import launched_externally
    from toolkit.worker import resolve_for_world, run_worker

    cfg = _config_from_args(args)
    if launched_externally():  # torchrun / srun / deepspeed made this process one rank
        run_worker(cfg)
        return 0
    resolve_for_world(cfg, cfg.nproc * args.nnodes)
    _check_data_before_launch(cfg)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    return _launch(cfg, args, run_dir / "config.yaml")


def _check_data_before_launch(cfg: RunConfig) -> None:
    """Tokenize and pack once here: bad data fails before any process group, and ranks hit the cache."""
    from toolkit.data import load_tokenizer, prepare_data
    prepare_data(cfg, load_tokenizer(cfg))


def _launch(cfg: RunConfig, args, config_path: Path) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from toolkit.launch import LaunchSpec, launch_workers
    spec = LaunchSpec(nproc=cfg.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint)
    print(f"toolkit: {cfg.backend} on {cfg.nproc} rank(s) x {args.nnodes} node(s); run dir {cfg.run_dir}", flush=True)
    try:
        launch_workers(spec, config_path)
    except ChildFailedError as exc:
        print(f"toolkit: training failed:\n{exc.format_msg()}", file=sys.stderr)
        return 1
    print(f"toolkit: done; metrics in {cfg.run_dir}/metrics.jsonl, model in {cfg.run_dir}/hf_final", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
