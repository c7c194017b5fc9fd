"""One rank of a training job: ``python -m toolkit.worker RUN_DIR/config.yaml``.

Started by our elastic launcher, torchrun, srun or the deepspeed launcher; reads the rank from the
environment they set.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from toolkit import device
from toolkit.adapters.hf import build_model, load_hf_config
from toolkit.config import ConfigError, RunConfig, dump_config, load_config
from toolkit.data import load_tokenizer, prepare_data
from toolkit.parallel import init_process_group, seed_everything


def resolve_for_world(cfg: RunConfig, world_size: int):
    """Backend config resolution and layout checks that need the world size (no communication)."""
    hf_config = load_hf_config(cfg.model.name_or_path)
    backend_config = None
    if cfg.backend == "deepspeed":
        from toolkit.adapters.deepspeed import resolve_ds_config
        backend_config = resolve_ds_config(cfg, world_size, hf_config.hidden_size)
    else:  # megatron
        from toolkit.adapters.megatron import apply_preset, check_layout
        apply_preset(cfg)
        backend_config = check_layout(cfg, hf_config, world_size)
    cfg.check_layout(world_size)
    return hf_config, backend_config


def run_worker(cfg: RunConfig) -> None:
    init_process_group()
    if device.strict_requested():
        device.enable_strict()
    device.use_tf32(cfg.model.tf32)
    rank, world = dist.get_rank(), dist.get_world_size()
    hf_config, backend_config = resolve_for_world(cfg, world)
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
    tokenizer, data = _prepare_data_rank0_first(cfg, rank)
    seed_everything(cfg.train.seed)
    engine = _build_engine(cfg, backend_config, run_dir, rank)
    from toolkit.trainer import Trainer
    Trainer(cfg, engine, data, tokenizer, hf_config, run_dir).fit()
    dist.barrier()
    dist.destroy_process_group()


def _prepare_data_rank0_first(cfg: RunConfig, rank: int):
    """Rank 0 tokenizes and fills the cache; the others then read it (no concurrent cache writes)."""
    if rank == 0:
        tokenizer = load_tokenizer(cfg)
        data = prepare_data(cfg, tokenizer)
    dist.barrier()
    if rank != 0:
        tokenizer = load_tokenizer(cfg)
        data = prepare_data(cfg, tokenizer)
    return tokenizer, data


def _build_engine(cfg: RunConfig, backend_config, run_dir: Path, rank: int):
    if cfg.backend == "megatron":
        from toolkit.adapters.megatron import build_engine
        return build_engine(cfg, backend_config, run_dir, rank)
    from toolkit.adapters.deepspeed import DeepSpeedEngine
    if rank == 0:
        import json
        (run_dir / "ds_config.json").write_text(json.dumps(backend_config, indent=2))
    return DeepSpeedEngine(cfg, build_model(cfg), backend_config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv = [a for a in argv if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    cfg = load_config(argv[0] if argv else None, argv[1:])
    run_worker(cfg)
    return 0


def forked_main(config_path: str, launcher_env: dict[str, str]) -> None:
    """A rank forked by the launcher's forkserver (``toolkit.launch``); ``main`` otherwise."""
    from toolkit.launch import adopt_launcher_env
    adopt_launcher_env(launcher_env)
    for stream in (sys.stdout, sys.stderr):  # as `python -u` for spawned ranks: lines appear as printed
        stream.reconfigure(line_buffering=True)
    main([config_path])


def preload_modules(backend: str) -> tuple[str, ...]:
    """What a rank of ``backend`` imports before it trains, for the launcher's forkserver to import once.
    Nothing that touches CUDA at import: the launcher forks ranks only on machines without a GPU."""
    common = ("torch", "transformers.modeling_utils", "datasets", "toolkit.data", "toolkit.trainer", "toolkit.worker")
    if backend == "megatron":
        return (*common, "megatron.core.models.gpt", "megatron.core.optimizer", "toolkit.adapters.megatron")
    return (*common, "deepspeed", "toolkit.adapters.deepspeed")


if __name__ == "__main__":
    sys.exit(main())
