"""Choosing and checking a run's layout: every rule of ``cfg`` on ``world`` ranks, with the numbers and
the valid choices in each message (a launch, the estimate and ``--dry-run`` call ``check_layout``);
the layout type itself and the rules it shares with the converter live in ``toolkit/layout.py``.
"""
from __future__ import annotations

from toolkit.config import ConfigError, RunConfig
from toolkit.layout import Layout, divisors, megatron_split_problems, valid_cp, valid_sp


def check_layout(cfg: RunConfig, spec, world: int) -> Layout:
    """Every layout rule for ``cfg`` on ``world`` ranks, with the numbers and the valid choices in
    each message; the validated layout. ``spec``: the ``ModelSpec`` (heads, layers, experts)."""
    if cfg.zero.sp > 1:
        _check_ulysses(cfg, spec, world)
    if cfg.zero.ep > 1:
        check_zero_ep(cfg, spec, world)
    _check_experts_implementation(cfg, spec)
    if cfg.backend == "deepspeed":
        lay = Layout(backend="deepspeed", world=world, dp=world // cfg.zero.sp, sp=cfg.zero.sp, ep=cfg.zero.ep,
                     zero_stage=cfg.zero.stage,
                     offload_optimizer=cfg.zero.offload_optimizer, offload_params=cfg.zero.offload_params,
                     offload_activations=cfg.zero.offload_activations,
                     recompute="full" if cfg.model.activation_checkpointing else "none")
    else:
        lay = _megatron_layout(cfg, spec, world)
    return lay.model_copy(update={"micro_batches": _micro_batches(cfg, lay.dp)})


def _check_ulysses(cfg: RunConfig, spec, world: int) -> None:
    """``zero.sp``: DeepSpeed only, dividing the world, the heads and the sequence. MoE models are fine:
    their load-balancing loss sums the routers' counts over the sequence group (``adapters/deepspeed/moe.py``)."""
    sp = cfg.zero.sp
    if cfg.backend != "deepspeed":
        raise ConfigError(f"zero.sp={sp} is DeepSpeed's Ulysses sequence parallelism and backend={cfg.backend}; "
                          "unset zero.sp, or set backend=deepspeed")
    heads = valid_sp(spec.heads, spec.kv_heads)
    if sp not in heads:
        raise ConfigError(f"num_attention_heads={spec.heads} and num_key_value_heads={spec.kv_heads} do not split "
                          f"over zero.sp={sp} (each rank takes heads / sp query heads and kv_heads / sp KV heads, "
                          f"or one KV head when sp is a multiple of them); choose sp in {heads}")
    if world % sp:
        fit = [s for s in heads if world % s == 0]
        raise ConfigError(f"world size {world} is not divisible by zero.sp={sp} (world = dp x sp); choose sp in "
                          f"{fit} or nproc a multiple of {sp}")
    if cfg.data.seq_len % sp:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is not divisible by zero.sp={sp}, which splits every "
                          f"row's tokens; choose seq_len a multiple of {sp}, or sp in "
                          f"{[s for s in heads if cfg.data.seq_len % s == 0 and world % s == 0]}")


AUTOEP_PRESETS = {"mixtral": "mixtral", "qwen2_moe": "qwen3_moe", "qwen3_moe": "qwen3_moe"}
"""Families DeepSpeed 0.19.8's AutoEP converts, and its preset for each (its ``qwen3_moe`` preset declares
``qwen2_moe`` too, with the gated shared expert); the toolkit's tests cover these three."""


def check_zero_ep(cfg: RunConfig, spec, world: int) -> None:
    """``zero.ep``: DeepSpeed's AutoEP on a family it has a preset for, experts and ranks divisible by ep,
    and none of the features it was not tested with (each refusal names the fix)."""
    ep, family = cfg.zero.ep, spec.model_type
    if not spec.experts:
        raise ConfigError(f"zero.ep={ep} is expert parallelism and needs a mixture-of-experts model; {family} has "
                          "no experts: unset zero.ep")
    if family not in AUTOEP_PRESETS:
        raise ConfigError(f"zero.ep={ep}: DeepSpeed's AutoEP has no preset for {family} (the toolkit runs it for "
                          f"{', '.join(sorted(AUTOEP_PRESETS))}); set zero.ep=1 (ZeRO shards the experts) or "
                          "backend=megatron with megatron.ep")
    fit = [d for d in divisors(spec.experts) if world % d == 0]
    if spec.experts % ep:
        raise ConfigError(f"{spec.experts} experts do not divide over zero.ep={ep}; choose zero.ep in {fit}")
    if world % ep:
        raise ConfigError(f"world size {world} is not divisible by zero.ep={ep} (ep consecutive ranks share the "
                          f"experts of each layer); choose zero.ep in {fit} or nproc a multiple of {ep}")
    refused = _zero_ep_refusals(cfg, spec)
    if refused:
        raise ConfigError(f"zero.ep={ep} (DeepSpeed's AutoEP) {refused}")


def _zero_ep_refusals(cfg: RunConfig, spec) -> str | None:
    """What ``zero.ep > 1`` does not run with, as "does not ... ; fix" (None: nothing)."""
    z = cfg.zero
    if z.sp > 1:
        return (f"does not run with zero.sp={z.sp} (AutoEP refuses sequence parallelism at ZeRO-3 and the toolkit "
                "has not tested it below); set zero.sp=1 or zero.ep=1")
    if z.tiled_mlp:
        return "replaces the MoE blocks that zero.tiled_mlp would tile; set zero.tiled_mlp=false"
    if spec.hf.get("router_jitter_noise"):
        return (f"routes without jitter, and this model's router_jitter_noise={spec.hf['router_jitter_noise']} would "
                "be ignored; set router_jitter_noise=0 in its config.json, or zero.ep=1")
    if cfg.lora.enabled or cfg.model.quantize != "none":
        return _zero_ep_lora_refusal(cfg, spec)
    if cfg.train.objective != "sft":
        return (f"is tested with train.objective=sft only, not {cfg.train.objective}; set zero.ep=1 for "
                f"{cfg.train.objective}")
    if z.offload_optimizer or z.offload_params:
        return ("is not tested with offloading (zero.offload_optimizer / zero.offload_params); unset them, or set "
                "zero.ep=1")
    return None


MOE_BLOCK_PARTS = ("gate", "router", "experts", "block_sparse_moe", "mlp")
"""Last names of what AutoEP replaces in an MoE block (the block, its router, its experts)."""


def _zero_ep_lora_refusal(cfg: RunConfig, spec) -> str | None:
    """LoRA under zero.ep trains adapters on attention with the experts, shared experts and
    routers frozen (``compat/deepspeed_frozen_experts.py``); AutoEP replaces the router and experts in
    ``deepspeed.initialize``, so what peft put on them would be dropped."""
    if cfg.model.quantize != "none":
        return ("does not run with a 4-bit base (model.quantize): AutoEP repacks the experts into its own "
                "layer; set model.quantize=none, or zero.ep=1 for QLoRA")
    targets = cfg.lora.target_modules
    if spec.hf.get("shared_expert_intermediate_size") and any(t == "all-linear" or "shared_expert" in t
                                                              for t in targets):
        return (f"does not put LoRA on the shared expert (lora.target_modules={targets}): AutoEP moves it into its "
                "own layer under other names, which the adapter/ and hf_final/ exports do not map back yet; name "
                "the attention modules (lora.target_modules=[q_proj,k_proj,v_proj,o_proj]), or zero.ep=1")
    moe_parts = [m for m in cfg.lora.modules_to_save if m.rsplit(".", 1)[-1] in MOE_BLOCK_PARTS]
    if moe_parts:
        return (f"does not train lora.modules_to_save={moe_parts}: AutoEP replaces the MoE blocks' routers and "
                "experts with its own modules, so peft's trained copies would be dropped; leave them out (LoRA "
                "trains attention and shared experts under zero.ep, experts and routers frozen), or zero.ep=1")
    if cfg.model.init != "pretrained":
        return ("with LoRA needs model.init=pretrained: hf_final/ merges the adapters onto the base read from its "
                "files (AutoEP's module holds only this rank's experts); set model.init=pretrained")
    return None


def _check_experts_implementation(cfg: RunConfig, spec) -> None:
    """``model.experts_implementation=grouped_mm`` on a model without routed experts is refused, as
    transformers refuses ``from_pretrained(experts_implementation="grouped_mm")`` for a class without
    experts; ``eager`` is what such a model runs anyway, and transformers accepts it silently too."""
    if cfg.model.experts_implementation == "grouped_mm" and not spec.experts:
        raise ConfigError(f"model.experts_implementation=grouped_mm needs a mixture-of-experts model; "
                          f"{spec.model_type} has no routed experts: set model.experts_implementation=auto "
                          "(or leave it out)")


def _micro_batches(cfg: RunConfig, dp: int) -> int:
    t = cfg.train
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % dp:  # no micro-batch size helps: say what does
        multiples = ", ".join(str(per_step * k) for k in (1, 2, 3))
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} cannot be split over dp={dp} data-parallel ranks "
            f"({t.global_batch_size} is not a multiple of {dp}); choose train.global_batch_size a multiple of {dp} x "
            f"train.micro_batch_size={t.micro_batch_size} ({multiples}), or a data-parallel size in "
            f"{divisors(t.global_batch_size)} (nproc x nodes / model-parallel ranks)")
    if t.global_batch_size % per_step:
        valid = [m for m in range(1, t.global_batch_size + 1) if t.global_batch_size % (m * dp) == 0]
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
            f"{t.micro_batch_size} x dp={dp}; choose micro_batch_size in {valid} or a global_batch_size that is "
            f"a multiple of {per_step}")
    return t.global_batch_size // per_step


def _megatron_layout(cfg: RunConfig, spec, world: int) -> Layout:
    m = cfg.megatron
    if world % (m.tp * m.pp * m.cp):
        cp = f" x megatron.cp={m.cp}" if m.cp > 1 else ""
        raise ConfigError(f"world size {world} is not divisible by megatron.tp={m.tp} x megatron.pp={m.pp}{cp}; "
                          f"choose tp x pp{' x cp' if cp else ''} in {divisors(world)} or nproc a multiple of "
                          f"{m.tp * m.pp * m.cp}")
    problems = megatron_split_problems(spec.heads, spec.kv_heads, spec.layers, spec.experts, m.tp, m.pp, m.ep,
                                       uneven=m.first_stage_layers is not None or m.last_stage_layers is not None,
                                       vpp=m.vpp, world=world, model=spec.model_type)
    if problems:
        raise ConfigError(problems[0])
    if m.first_stage_layers is not None or m.last_stage_layers is not None:
        _check_uneven_split(m, spec.layers)
    dp = world // (m.tp * m.pp * m.cp)
    if m.cp > 1:
        _check_context_parallel(m, spec, cfg.data.seq_len)
    if m.vpp:
        _check_interleaving(cfg, dp)
    if m.sequence_parallel:
        _check_sequence_parallel(m, cfg.data.seq_len)
    _check_experts(m, spec, world)
    return Layout(backend="megatron", world=world, dp=dp, tp=m.tp, pp=m.pp, vpp=m.vpp, ep=m.ep, cp=m.cp,
                  sequence_parallel=m.sequence_parallel, first_stage_layers=m.first_stage_layers,
                  last_stage_layers=m.last_stage_layers, recompute=m.recompute,
                  vocab_divisor=m.make_vocab_size_divisible_by).with_vocab(spec.vocab)


def _check_interleaving(cfg: RunConfig, dp: int) -> None:
    m = cfg.megatron
    n_micro = cfg.train.global_batch_size // max(cfg.train.micro_batch_size * dp, 1)
    if n_micro % m.pp:
        raise ConfigError(f"interleaved pipeline (megatron.vpp={m.vpp}) needs micro-batches per step ({n_micro} = "
                          f"global_batch_size / (micro_batch_size x dp={dp})) divisible by pp={m.pp}")


def _check_experts(m, spec, world: int) -> None:
    """Expert parallelism: ep divides the experts and, with tp and pp, the world (megatron carves the
    ep ranks out of each DP group; expert tensor parallelism equals tp). Whether the dispatcher can
    run on this machine is the engine's question (``alltoall`` needs GPUs), not the plan's."""
    if not spec.experts:
        return
    if world % (m.tp * m.ep * m.pp):
        raise ConfigError(f"world size {world} is not divisible by megatron.tp={m.tp} x ep={m.ep} x pp={m.pp}; "
                          f"use nproc a multiple of {m.tp * m.ep * m.pp} or a smaller ep")
    if m.tp > 1 and not m.sequence_parallel:
        raise ConfigError(f"megatron.tp={m.tp} with a mixture-of-experts model needs megatron.sequence_parallel=true "
                          "(megatron-core's MoE layer requires it under tensor parallelism)")


def _check_context_parallel(m, spec, seq_len: int) -> None:
    """megatron.cp > 1: the toolkit's attention does the exchange (megatron's local one has none),
    heads per TP rank divide over cp, rows split into 2 x cp equal chunks (x tp under sequence
    parallelism: each chunk then splits over the TP ranks)."""
    if m.attention == "local":
        raise ConfigError(f"megatron.cp={m.cp} needs the toolkit's core attention (megatron's local "
                          "DotProductAttention has no context parallelism without Transformer Engine); "
                          "set megatron.attention=auto")
    heads_per_tp = spec.heads // m.tp
    valid = valid_cp(spec.heads, m.tp, seq_len, m.sequence_parallel)
    if heads_per_tp % m.cp:
        raise ConfigError(f"num_attention_heads={spec.heads} / megatron.tp={m.tp} = {heads_per_tp} heads per TP rank "
                          f"do not divide over megatron.cp={m.cp} (the all-to-all gives each CP rank whole heads); "
                          f"choose cp in {valid}")
    rows = 2 * m.cp * (m.tp if m.sequence_parallel else 1)
    if seq_len % rows:
        what = f"2 x megatron.cp={m.cp}" + (f" x megatron.tp={m.tp} (sequence parallelism)" if m.sequence_parallel else "")
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by {what} = {rows}: each row splits into 2 x cp "
                          f"load-balanced chunks; choose seq_len a multiple of {rows}, or cp in {valid}")


def _check_sequence_parallel(m, seq_len: int) -> None:
    if m.tp < 2:
        raise ConfigError(f"megatron.sequence_parallel=true splits the sequence over the TP group and needs "
                          f"megatron.tp >= 2 (got tp={m.tp}); raise tp or set sequence_parallel=false")
    if seq_len % m.tp:
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by megatron.tp={m.tp}, which sequence "
                          f"parallelism splits it over; choose seq_len a multiple of {m.tp}")


def _check_uneven_split(m, layers: int) -> None:
    first, last = m.first_stage_layers, m.last_stage_layers
    if m.pp < 2 or m.vpp:
        raise ConfigError(f"megatron.first_stage_layers/last_stage_layers need pp >= 2 and no vpp (got pp={m.pp}, "
                          f"vpp={m.vpp}); unset them or change the layout")
    fixed = [n for n in (first, last) if n is not None]
    if any(n < 1 for n in fixed):
        raise ConfigError(f"megatron.first_stage_layers={first}, last_stage_layers={last}: each stage needs >= 1 layer")
    middle, rest = m.pp - len(fixed), layers - sum(fixed)
    if rest < middle or (middle == 0 and rest != 0) or (middle and rest % middle):
        raise ConfigError(f"num_hidden_layers={layers} minus first_stage_layers={first} and last_stage_layers={last} "
                          f"leaves {rest} layers for the other {middle} stage(s) of pp={m.pp}; they must divide "
                          "evenly with at least one layer each")




def check_vision(cfg: RunConfig, hf_config) -> None:
    """A vision-language model (``families/vision.py``, ``docs/vlm.md``): what its path takes, each refusal
    with its reason and fix."""
    from toolkit.families.vision import find_vision
    kind = f"model_type={hf_config.model_type!r} is a vision-language model"
    if find_vision(hf_config.model_type) is None:
        raise ConfigError(f"{kind} the toolkit has no vision table for: add its entry (tower, projector, image "
                          "token) to toolkit/families/vision.py")
    if cfg.model.init == "random" and not find_vision(hf_config.model_type).seeded_init:
        raise ConfigError(f"{kind} whose top-level init does not draw its vision tower as the tower's own class "
                          "does (measured: some tower parameters left uninitialized), so model.init=random is "
                          "refused: save the model with transformers (AutoModelForImageTextToText.from_config(...)"
                          ".save_pretrained(DIR); examples/vlm/build.py does) and use model.init=pretrained")
    if cfg.backend == "megatron":
        raise ConfigError(f"{kind}, and the toolkit's megatron path builds a GPTModel from family tables, with no "
                          "vision tower: use backend=deepspeed")
    d = cfg.data
    refusals = [
        (cfg.train.objective != "sft", f"train.objective={cfg.train.objective}: preference pairs with images are "
                                        "not built yet: use train.objective=sft"),
        (d.template != "chat", f"data.template={d.template!r}: its rows are image-text conversations; set "
                               "data.template=chat (messages with {'type': 'image'} parts, images in data.images_column)"),
        (d.packing_mode == "concat", "data.packing=concat would cut an image's tokens across rows: use "
                                     "data.packing=documents or pad"),
        (d.overflow == "split" and "overflow" in d.model_fields_set,
         "data.overflow=split would cut an image's tokens: use data.overflow=drop (documents longer than "
         "data.seq_len are dropped and counted; raise data.seq_len to keep them)"),
        (d.streaming or d.weights is not None or d.format == "megatron",
         "its rows are read from one file source (data.streaming, blends and Megatron prefixes carry no images): "
         "unset them"),
        (cfg.zero.sp > 1, f"zero.sp={cfg.zero.sp}: the model merges image features into the whole sequence "
                          "before any split: unset zero.sp"),
        (cfg.zero.tiled_mlp or cfg.zero.tiled_loss, "zero.tiled_mlp/tiled_loss are not measured on vision "
                                                   "models (tiling would reach the tower's MLPs): unset them"),
        (cfg.model.quantize != "none", f"model.quantize={cfg.model.quantize}: a 4-bit vision-language base is not "
                                       "built yet: set model.quantize=none"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{kind}: {why}")
