"""Rank functions and helpers for the converter tests: tiny models trained and saved by DeepSpeed's
own engine, and loaded back by DeepSpeed / megatron-core's own loaders."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from toolkit.adapters.hf import param_groups
from toolkit.families.tiny import TINY, TINY_MOE, tiny_model

FAMILIES = tuple(sorted(TINY))  # every dense family: a new one is converted by being added
MOE_FAMILIES = tuple(sorted(TINY_MOE))
FROZEN = "llama_frozen"
"""llama with its input embedding and layer 0's q_proj frozen (requires_grad=False), as a LoRA or
partial fine-tune leaves them: DeepSpeed saves those outside the optimizer state."""
STAGES = (1, 2, 3)


def ds_config(stage: int, world: int, universal: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
           "gradient_clipping": 1.0}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _engine(family: str, stage: int, world: int, universal: bool = False, seed: int = 0):
    import deepspeed

    from toolkit.compat import cpuinfo_cache
    cpuinfo_cache.install()  # as the toolkit's engine does: no cpuinfo subprocess per op load
    model = tiny_model(family.removesuffix("_frozen"), seed=seed).train()
    if family == FROZEN:
        model.model.embed_tokens.weight.requires_grad_(False)
        model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1),
                                      config=ds_config(stage, world, universal))
    return engine


def step_batch(rank: int, vocab: int, seed: int) -> torch.Tensor:
    """DP rank ``rank``'s ``[1, 12]`` token batch at step ``seed`` of ``_step``."""
    return torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(seed * 100 + rank))


def _step(engine, rank: int, vocab: int, seed: int) -> float:
    ids = step_batch(rank, vocab, seed)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def save_zero_checkpoints(rank: int, world: int, root: str, combos, steps: int = 2):
    """Each (family, stage) at this DP size: a few steps of DeepSpeed, then its save_checkpoint."""
    for family, stage in combos:
        engine = _engine(family, stage, world)
        for s in range(steps):
            _step(engine, rank, engine.module.config.vocab_size, s)
        out = Path(root) / f"{family}-z{stage}-dp{world}"
        engine.save_checkpoint(str(out), tag=f"global_step{steps}")
        if rank == 0:  # an HF Trainer checkpoint-N/ has the model's config.json beside global_stepN/
            engine.module.config.to_json_file(str(out / "config.json"))
        engine.destroy()
    return True


def build_zero_checkpoints(tmp_path_factory, name: str, matrix) -> Path:
    """``ROOT/FAMILY-zSTAGE-dpDP`` for each (family, stage, dp) of ``matrix``, written by DeepSpeed
    itself: one ``run_ranks`` job per DP size saves all of that size's combinations."""
    from tests.helpers.ranks import run_ranks
    root = tmp_path_factory.mktemp(name)
    for dp in sorted({d for _, _, d in matrix}):
        combos = [(f, s) for f, s, d in matrix if d == dp]
        run_ranks(save_zero_checkpoints, dp, tmp_path_factory.mktemp(f"{name}_ranks{dp}"), str(root), combos,
                  timeout=900)
    return root


def load_universal(rank: int, world: int, family: str, stage: int, ckpt: str):
    """DeepSpeed's own load_checkpoint of a universal checkpoint at (stage, world); the full fp32
    weights and Adam moments it then holds, gathered with DeepSpeed's own accessors."""
    engine, out, steps = _deepspeed_loaded(family, stage, world, ckpt, universal=True)
    _step(engine, rank, engine.module.config.vocab_size, 7)  # it trains on from there
    engine.destroy()
    return {"tensors": out if rank == 0 else None, "steps": steps}


def _deepspeed_loaded(family: str, stage: int, world: int, ckpt: str, universal: bool):
    """(engine, {HF name: {param, exp_avg, exp_avg_sq}}, {Adam step as 'type value'}) after
    DeepSpeed's own load_checkpoint, read with DeepSpeed's own accessors."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    engine = _engine(family, stage, world, universal=universal, seed=99)  # other init: all must come from ckpt
    path, _ = engine.load_checkpoint(ckpt, load_optimizer_states=True, load_lr_scheduler_states=False)
    assert path is not None
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO 1-2 link these at the first
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # step; a universal load links them itself
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {"param": safe_get_full_fp32_param(p).clone(),
                     "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                     "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
    steps = {str(type(s.get("step"))) + str(s.get("step")) for s in engine.optimizer.optimizer.state.values()} \
        if hasattr(engine.optimizer, "optimizer") else set()
    return engine, out, steps


def _megatron_loaded(family: str, ckpt: str) -> dict:
    """{HF name: {param, exp_avg, exp_avg_sq}} and Adam steps that megatron-core's own
    dist_checkpointing.load (through MegatronEngine.load, one rank: the distributed optimizer holds
    every parameter whole) puts into the model and megatron's distributed optimizer. Moments are
    mapped to HF names by the same export path as the weights (``hf_state``)."""
    from tests.helpers.ranks import megatron_engine, release_megatron
    from toolkit.config import validate
    model = tiny_model(family, seed=99)  # a different init: everything must come from the checkpoint
    cfg = validate({"backend": "megatron", "train": {"global_batch_size": 1, "micro_batch_size": 1}})
    engine = megatron_engine(cfg, model)
    engine.load(Path(ckpt))
    steps = set()
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for chunk in engine.model:
            for p in chunk.module.parameters():
                group, order = opt.model_param_group_index_map[p]
                state = opt.optimizer.state.get(opt.optimizer.param_groups[group]["params"][order])
                if not state:  # a fresh torch Adam: zero moments, step 0 (it creates them at its first step)
                    state = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": 0}
                assert state["exp_avg"].numel() == p.numel()  # one DP rank: the whole parameter
                p.loaded_exp_avg, p.loaded_exp_avg_sq = (state[k].view(p.shape) for k in ("exp_avg", "exp_avg_sq"))
                steps.add(float(state["step"]))
    loaded = {"param": engine.hf_state(), "exp_avg": engine.hf_state("loaded_exp_avg"),
              "exp_avg_sq": engine.hf_state("loaded_exp_avg_sq")}
    release_megatron()
    return {"tensors": {n: {k: v[n] for k, v in loaded.items()} for n in loaded["param"]}, "steps": steps}


def optimizer_state_by_engines(rank: int, world: int, family: str, ckpts: dict[str, str]) -> dict:
    """One rank: {name: what DeepSpeed's or megatron-core's own loader holds after loading that
    checkpoint}. ``ckpts``: name -> path, a name starting with ``zero_src`` (DeepSpeed's own save),
    ``zero`` (a universal checkpoint) or ``meg``. DeepSpeed first: megatron's CPU layer stays on for
    the rest of the process."""
    views = {}
    for name, ckpt in sorted(ckpts.items(), key=lambda kv: kv[0].startswith("meg")):
        if name.startswith("meg"):
            views[name] = _megatron_loaded(family, ckpt)
            continue
        engine, tensors, steps = _deepspeed_loaded(family, 2, world, ckpt, universal=not name.startswith("zero_src"))
        engine.destroy()
        views[name] = {"tensors": tensors, "steps": steps}
    return views


def write_config(path: Path, family: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_model(family).config.to_dict()))


def megatron_load_families(rank: int, world: int, tp: int, pp: int, ckpts: dict[str, str], ep: int = 1):
    """``megatron_load`` of each family's checkpoint in turn on these ranks: {family: HF weights}."""
    from tests.helpers.ranks import release_megatron
    out = {}
    for family, ckpt in ckpts.items():
        out[family] = megatron_load(rank, world, family, tp, pp, ckpt, ep)["weights"]
        release_megatron()
    return out


def megatron_load(rank: int, world: int, family: str, tp: int, pp: int, ckpt: str, ep: int = 1):
    """megatron-core's own dist_checkpointing.load (through the toolkit's MegatronEngine.load) of a
    converted torch_dist checkpoint at (tp, pp, ep); the HF weights it then holds."""
    from tests.helpers.ranks import megatron_engine
    from toolkit.config import validate
    model = tiny_model(family, seed=99)  # a different init: everything must come from the checkpoint
    cfg = validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, "ep": ep},
                    "train": {"global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-2, "weight_decay": 0.1}})
    engine = megatron_engine(cfg, model)
    engine.load(Path(ckpt))
    return {"weights": engine.hf_state()}


def save_legacy_megatron(rank: int, world: int, family: str, tp: int, pp: int, root: str):
    """Megatron-LM's legacy layout written from megatron-core's own module state dicts:
    ``iter_0000003/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` with ``model``, ``args``,
    ``iteration``; returns the HF weights the engine holds (rank 0)."""
    import argparse

    import torch.distributed as dist

    from tests.helpers.ranks import megatron_engine
    from toolkit.config import validate
    model = tiny_model(family, seed=3)
    cfg = validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp},
                    "train": {"global_batch_size": 2, "micro_batch_size": 1}})
    engine = megatron_engine(cfg, model)
    name = f"mp_rank_{engine.tp_rank:02d}" + (f"_{engine.pp_rank:03d}" if pp > 1 else "")
    out = Path(root) / "iter_0000003" / name
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(num_layers=model.config.num_hidden_layers, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp)
    torch.save({"model": engine.model[0].module.state_dict(), "args": args, "iteration": 3,
                "checkpoint_version": 3.0}, out / "model_optim_rng.pt")
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("3")
    weights = engine.hf_state()
    dist.barrier()
    return {"weights": weights}


PREBUILT = os.environ.get("TOOLKIT_CONVERT_CKPTS")
"""Development shortcut: a directory a previous session's fixture wrote (tests then skip DeepSpeed)."""
