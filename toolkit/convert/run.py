"""``convert``: open SRC, pick the writer, stage the output, describe it for the toolkit's resume."""
from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

from toolkit.config import DTYPE_NAMES  # names only: the direct ZeRO -> HF route imports no torch
from toolkit.formats.canonical import Source, WriteRequest
from toolkit.formats.errors import ConvertError
from toolkit.formats.table import TARGETS, backend_targets, by_name, for_target
from toolkit.layout import DEFAULT_VOCAB_DIVISOR, Layout


def convert(src, dst, to: str | None = None, tp: int = 1, pp: int = 1, ep: int = 1, dp: int | None = None,
            zero_stage: int = 2, dtype: str | None = None, weights_only: bool = False, hf_config: str | None = None,
            max_shard_bytes: int = 5 << 30, show_progress: bool = False, base: str | None = None,
            vocab_divisor: int | None = None, *, layout: Layout | None = None) -> dict:
    """Convert SRC (a path, or where ``formats.detect.locate`` found one) into DST (which must not
    exist). ``to`` defaults to hf (to zero for an HF source); ``dp`` to the smallest size the layout
    allows (``ep`` for megatron, else 1). Returns a summary: formats, tensors, step, optimizer state,
    which reader ran (the torch-free ZeRO -> HF route or the torch one), seconds. LoRA adapters (a
    toolkit LoRA checkpoint, an HF-PEFT directory, a DCP of a peft model: formats of the table too)
    convert whole: ``--to peft``, ``--to hf`` (merged onto their base, or onto ``base``:
    ``lora/convert.py``), or ``--to zero|megatron`` as that backend's LoRA checkpoint.
    ``vocab_divisor``: the megatron output's ``make_vocab_size_divisible_by`` (default: the megatron
    source's recorded one, else megatron's 128); a run resumes it only at its own divisor. ``layout``
    (keyword only; a resume's reshard passes its run's, ``Layout.for_checkpoint``) stands for
    ``tp``/``pp``/``ep``/``dp``/``zero_stage``/``vocab_divisor``."""
    from toolkit.formats.detect import Located, locate, open_located
    from toolkit.formats.direct import open_direct
    from toolkit.formats.staging import staged
    tic = time.perf_counter()
    found = src if isinstance(src, Located) else locate(src, hf_config)
    src = found.path if isinstance(src, Located) else src
    if by_name(found.format).adapters:
        asked = layout or _asked_layout(to, tp, pp, ep, dp, zero_stage, vocab_divisor)
        summary = _convert_adapters(found, Path(dst), to, asked, layout is None and vocab_divisor is None,
                                    weights_only, hf_config, max_shard_bytes, base)
        return {**summary, "src": str(src), "seconds": round(time.perf_counter() - tic, 3)}
    if base is not None:
        raise ConvertError(f"--base {base}: applies to LoRA sources only (an HF-PEFT directory or a toolkit LoRA "
                           f"checkpoint); {found.path} is {found.format}")
    to = to or ("zero" if found.format == "hf" else "hf")
    if to in TARGETS and for_target(to).adapters:
        raise ConvertError(f"--to {to}: writes LoRA adapters, from a LoRA source only (a toolkit LoRA checkpoint, an "
                           f"HF-PEFT directory or a DCP of a peft model); {found.path} is {found.format}")
    asked = layout or _asked_layout(to, tp, pp, ep, dp, zero_stage, vocab_divisor)
    _check_request(found.hf_config, to, asked, dtype, None if layout else vocab_divisor)
    direct = open_direct(found) if to == "hf" and dtype is None else None  # None: the torch reader does it
    source = direct or open_located(found)
    try:
        with staged(Path(dst)) as stage, _progress(source, show_progress) as progress:
            if direct is not None:
                direct.write_hf(stage, max_shard_bytes, progress)
            else:
                if layout is None and vocab_divisor is None:  # keep a megatron source's padding
                    asked = _with_source_divisor(asked, source)
                request = WriteRequest(layout=asked, dtype=_torch_dtype(dtype), weights_only=weights_only,
                                       max_shard_bytes=max_shard_bytes)
                _write(source, stage, for_target(to), request, progress)
    finally:
        source.close()
    return {"src": str(src), "dst": str(dst), "from": source.format, "to": to, "family": source.model_type,
            "tensors": len(source.infos), "step": source.step,
            "optimizer_state": to != "hf" and source.has_optimizer and not weights_only,
            "reader": "torch-free" if direct is not None else "torch", "seconds": round(time.perf_counter() - tic, 3)}


def _convert_adapters(found, dst: Path, to: str | None, layout: Layout, source_divisor: bool, weights_only: bool,
                      hf_config: str | None, max_shard_bytes: int, base: str | None) -> dict:
    """LoRA adapters, whole: as another backend's LoRA checkpoint (``--to zero|megatron``), else as an
    adapter directory or merged onto its base (``lora/convert.py``), through the format's own
    functions (``table.Format.lora_checkpoint`` / ``lora_adapter``)."""
    fmt = by_name(found.format)
    if to in backend_targets():
        return _convert_lora_checkpoint(fmt.open_lora_checkpoint(found, base), dst, to, layout, source_divisor,
                                        weights_only)
    from toolkit.lora.convert import convert_adapter
    adapter, described = fmt.open_adapter(found, base, hf_config)
    try:
        summary = convert_adapter(adapter, found.path, dst, to or "hf", max_shard_bytes, described.get("step"),
                                  base_given=base is not None)
    finally:
        if adapter.base_source is not None:
            adapter.base_source.close()
    return {**summary, "from": described["format"]}


def _convert_lora_checkpoint(source, dst: Path, to: str, layout: Layout, source_divisor: bool,
                             weights_only: bool) -> dict:
    """A LoRA checkpoint's stream (a toolkit LoRA checkpoint of either backend, or an HF-PEFT
    directory as step 0) written as one of ``to``'s backend (``lora/checkpoint.py``)."""
    from toolkit.formats.staging import staged
    from toolkit.lora.checkpoint import write_lora
    meta = source.meta
    _check_request(source.hf_config, to, layout, None)
    if source_divisor:  # no divisor asked for: keep a megatron source's padding
        layout = _with_source_divisor(layout, source)
    described = {k: meta[k] for k in ("lora", "base_model") if k in meta}
    notes = []
    if to == "megatron" and "quantization" in described.get("base_model", {}):
        described["base_model"], notes = _unquantized_base(described["base_model"])
    with staged(dst) as stage:
        record = write_lora(source, stage, layout=layout, weights_only=weights_only)
        describe_for_resume(source, stage, for_target(to).backend, record, None, layout.world, described)
    return {"src": str(source.path), "dst": str(dst), "from": source.format, "to": to, "family": source.model_type,
            "tensors": len(source.infos), "step": source.step, "optimizer_state": source.has_optimizer and not weights_only,
            "reader": "torch", "notes": notes}


def _unquantized_base(base: dict) -> tuple[dict, list[str]]:
    """A QLoRA checkpoint's base record for a megatron one (megatron-core has no 4-bit path): the base is
    unquantized there, so the record says so (a megatron resume is then not refused) and keeps what the
    adapters trained on as ``trained_on_quantization``; and the line saying the difference."""
    q = base["quantization"]
    kept = {k: v for k, v in base.items() if k != "quantization"}
    note = (f"note: the adapters trained on a {q['quant_type']}-quantized base (model.quantize={q['quant_type']}); "
            "written as LoRA adapters for the unquantized base (megatron-core has no 4-bit path): on it they add "
            "to the full-precision weights, not to the dequantized ones they trained with, so the function differs "
            "from the trained one (toolkit convert CKPT OUT --to hf --base BASE prints by how much)")
    return {**kept, "trained_on_quantization": q}, [note]


def _asked_layout(to: str | None, tp: int, pp: int, ep: int, dp: int | None, zero_stage: int,
                  vocab_divisor: int | None) -> Layout:
    """The output's layout from the converter's flags (checked by ``_check_request``); the divisor
    megatron's default until a source says otherwise (``_with_source_divisor``)."""
    return Layout.of_sizes("megatron" if to == "megatron" else "deepspeed", dp=_dp_or_default(dp, to, ep), tp=tp,
                           pp=pp, ep=ep, zero_stage=zero_stage, vocab_divisor=vocab_divisor or DEFAULT_VOCAB_DIVISOR)


def _with_source_divisor(layout: Layout, source) -> Layout:
    """No divisor asked for: the one a megatron source was written with (so a converted checkpoint
    keeps its run's padded vocabulary), else megatron's."""
    return layout.model_copy(update={"vocab_divisor": getattr(source, "vocab_divisor", None) or DEFAULT_VOCAB_DIVISOR})


def _torch_dtype(name: str | None):
    if name is None:
        return None
    import torch
    return getattr(torch, DTYPE_NAMES[name])


def _dp_or_default(dp: int | None, to: str, ep: int) -> int:
    """``--dp``, or when not given the smallest the layout allows (``ep`` for megatron, else 1); a given 0
    stays 0 and is refused, never read as the default."""
    return dp if dp is not None else (ep if to == "megatron" else 1)


def _check_request(hf_config: dict, to: str, layout: Layout, dtype: str | None, vocab_divisor: int | None = None) -> None:
    """The asked-for layout against the converter's rules, named by its flags (``vocab_divisor``: the
    ``--vocab-divisor`` given, if any)."""
    tp, pp, ep, dp, stage = layout.tp, layout.pp, layout.ep, layout.dp, layout.zero_stage
    if to not in TARGETS:
        raise ConvertError(f"--to {to!r}: choose one of {list(TARGETS)}")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {list(DTYPE_NAMES)}")
    if min(tp, pp, dp, ep) < 1:
        raise ConvertError(f"--tp {tp} --pp {pp} --ep {ep} --dp {dp}: each must be >= 1")
    if to == "zero" and stage not in (1, 2, 3):
        raise ConvertError(f"--zero-stage {stage}: choose 1, 2 or 3")
    if to != "megatron" and (tp, pp, 1 if to == "zero" else ep) != (1, 1, 1):
        raise ConvertError(f"--tp/--pp apply to --to megatron only, --ep to megatron and zero (got --to {to})")
    if to == "zero" and ep > 1:
        _check_autoep_layout(hf_config, ep, dp)
    if vocab_divisor is not None and (to != "megatron" or vocab_divisor < 1):
        raise ConvertError(f"--vocab-divisor {vocab_divisor}: a positive integer, and for --to megatron only "
                           f"(got --to {to}); use the run's megatron.make_vocab_size_divisible_by")
    if to == "megatron":
        _check_megatron_layout(hf_config, tp, pp, ep)
        if dp % ep:
            raise ConvertError(f"--dp {dp} --ep {ep}: megatron takes the ep ranks from the dp ranks; choose dp a "
                               f"multiple of {ep}")


def _check_autoep_layout(config: dict, ep: int, dp: int) -> None:
    """``--to zero --ep N``: a checkpoint for a ``zero.ep=N`` run (DeepSpeed's AutoEP), whose plan rules apply."""
    from toolkit.plan.checks import AUTOEP_PRESETS
    family, experts = config.get("model_type"), _experts(config)
    if family not in AUTOEP_PRESETS or not experts:
        raise ConvertError(f"--to zero --ep {ep}: AutoEP checkpoints are written for {sorted(AUTOEP_PRESETS)}, not "
                           f"{family}; drop --ep")
    if experts % ep or dp % ep:
        raise ConvertError(f"--to zero --ep {ep} --dp {dp}: ep must divide the {experts} experts and dp")


def _check_megatron_layout(config: dict, tp: int, pp: int, ep: int = 1) -> None:
    """The run plan's megatron split rules (``toolkit.layout``), named by the converter's flags."""
    from toolkit.convert.inspect import split_dims
    from toolkit.families import find_family
    from toolkit.layout import megatron_split_problems
    family = find_family(config.get("model_type"))
    missing = family.missing_fields(config) if family else []
    if missing:
        raise ConvertError(f"config.json (model_type={config.get('model_type')!r}) has no {', '.join(missing)}: "
                           "the megatron layout needs each; add them as the model's published config.json "
                           "has them (transformers' class defaults are not this checkpoint's shapes)")
    heads, kv_heads, layers = split_dims(config)
    problems = megatron_split_problems(heads, kv_heads, layers, _experts(config), tp, pp, ep,
                                       model=str(config.get("model_type")),
                                       names={"tp": "--tp", "pp": "--pp", "vpp": "vpp", "ep": "--ep"})
    if problems:
        raise ConvertError(problems[0])


def _experts(config: dict) -> int:
    from toolkit.families import find_family
    from toolkit.formats.canonical import hf_config_object
    family = find_family(config.get("model_type"))
    return family.num_experts(hf_config_object(config)) if family else 0


def _write(source: Source, stage: Path, fmt, request: WriteRequest, progress) -> None:
    """``fmt``'s writer into ``stage``; a backend's format goes under ``engine/`` of a toolkit
    checkpoint, described so that a run resumes it."""
    if fmt.backend is None:
        fmt.write(source, stage, request, progress)
        return
    layout = fmt.write(source, stage / "engine", request, progress)
    describe_for_resume(source, stage, fmt.backend, layout, request.dtype, request.layout.world)


def describe_for_resume(source: Source, stage: Path, backend: str, layout: dict, dtype, world: int,
                        extra: dict | None = None) -> None:
    """The descriptions and per-rank RNG files of a toolkit checkpoint of ``backend`` (deepspeed or
    megatron; ``toolkit/storage/meta.py``), so ``toolkit train --resume auto`` continues from DST
    placed under ``RUN/checkpoints/``."""
    import torch

    from toolkit.parallel import rng_state, seed_everything, set_rng_state
    from toolkit.storage import meta
    progress = dict(source.trainer_state or {"step": source.step or 0})
    step = progress["step"]
    meta.write_descriptions(stage, backend, source.model_type,
                            source.hf_config, layout, {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"),
                            progress, converted_from={"path": str(source.path), "format": source.format,
                                                      "layout": source.layout}, **(extra or {}))
    # RNG streams of the source ranks mean nothing at another layout: each rank gets the state a
    # resharding resume would give it (seeded from seed + step), the converter's own RNG untouched.
    saved = rng_state()
    try:
        seed_everything(int(progress.get("seed", 0)) + step)
        state = rng_state()
        meta.rng_file(stage, 0).parent.mkdir()
        for rank in range(world):
            torch.save(state, meta.rng_file(stage, rank))
    finally:
        set_rng_state(saved)


def _progress(source, show: bool):
    """A rich progress bar over bytes written and tensors done (a no-op when not shown). ``source``:
    a ``Source``, or the direct route's reader (``infos``: name -> anything with ``nbytes``)."""
    if not show:
        return nullcontext(None)
    return _RichProgress(source)


class _RichProgress:
    def __init__(self, source):
        self.total = sum(i.nbytes for i in source.infos.values())
        self.count = len(source.infos)

    def __enter__(self):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TextColumn("{task.fields[tensors]} tensors"), TimeElapsedColumn(), transient=False)
        self.bar.__enter__()
        self.task = self.bar.add_task("converting", total=self.total, tensors=0)
        self.done = 0
        return self

    def __call__(self, name: str, nbytes: int) -> None:
        self.done += 1
        self.bar.update(self.task, advance=nbytes, tensors=self.done, description=name[-40:])

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)
