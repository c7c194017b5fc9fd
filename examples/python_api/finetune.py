"""Fine-tune from Python: the embedded demo config with a few keys changed, its plan, a short run,
and the trained model converted to a DeepSpeed ZeRO checkpoint.

    python examples/python_api/finetune.py --run-dir runs/python_api --steps 20
    python examples/python_api/finetune.py --run-dir runs/python_api_1 --steps 20 --in-process

By default ``toolkit.train`` starts the ranks exactly as ``toolkit train`` does (``nproc`` local
ranks, 2 in the demo, under torch's elastic agent with the restart policy): a job of several ranks
needs that launcher. ``--in-process`` trains one rank in this process instead, with the pieces each
launched rank runs (``toolkit.build_engine`` and ``toolkit.Trainer``; ``toolkit/train/worker.py``).
Extra ``--set KEY=VALUE`` override any config key, as on the command line.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import toolkit


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cfg = toolkit.load_config(None, [f"run_dir={args.run_dir}", f"train.steps={args.steps}", "train.log_every=1",
                                     "train.warmup_steps=2", "checkpoint.every=0",
                                     *(["nproc=1"] if args.in_process else []), *args.set])
    plan = toolkit.build_plan(cfg, [cfg.nproc])
    trained, total = plan.trainable_parameters()
    print(f"{plan.model.model_type}: {trained:,} of {total:,} parameters train, {cfg.backend} on {cfg.nproc} rank(s), "
          f"{cfg.train.steps} steps of {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens")
    if args.in_process:
        train_in_this_process(plan)
    elif (code := toolkit.train(plan)) != 0:
        return code
    losses = read_losses(Path(cfg.run_dir))
    print(f"loss {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {len(losses)}")
    if not all(math.isfinite(loss) for loss in losses):
        return 1
    zero = Path(cfg.run_dir) / "zero"
    summary = toolkit.convert(Path(cfg.run_dir) / "hf_final", zero, to="zero")
    print(f"converted {summary['tensors']} tensors to {summary['to']}: {toolkit.inspect(zero)['format']} in {zero}")
    return 0


def train_in_this_process(plan) -> None:
    """One rank here, as a launched rank runs it; the process group is a world of one."""
    import torch.distributed as dist

    from toolkit.data import load_tokenizer, prepare_data
    from toolkit.parallel import init_process_group, seed_everything
    init_process_group()  # RANK 0 of WORLD_SIZE 1 on a free local port, unless a launcher set them
    run_dir = Path(plan.config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(plan.config)
    data = prepare_data(plan.config, tokenizer)
    seed_everything(plan.config.train.seed)
    engine = toolkit.build_engine(plan, run_dir, rank=0)
    toolkit.Trainer(plan, engine, data, tokenizer, run_dir).fit()  # writes metrics.jsonl and hf_final/
    dist.destroy_process_group()


def read_losses(run_dir: Path) -> list[float]:
    """Training loss per step, from the run's metrics.jsonl."""
    from toolkit.observe.metrics import read_metrics
    return [row["loss"] for _, row in sorted(read_metrics(run_dir).items())]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/python_api")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--in-process", action="store_true", help="one rank in this process (no launcher)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    return p.parse_args(argv)


if __name__ == "__main__":  # as any script that starts processes: importing it starts nothing
    raise SystemExit(main())
