"""LoRA checkpoints of either backend (adapters only) as one stream, written at any layout of either:
``toolkit convert LORA_CKPT OUT --to zero [--dp N --zero-stage S]`` or ``--to megatron --tp N``,
Adam moments and step carried, so ``toolkit train --resume auto`` continues the run on the other
backend (``--to peft`` / ``--to hf``: ``lora/convert.py``).

Both backends name the trained tensors by peft parameter name in HF shapes, so the stream is
``LoraSource``: name -> (fp32 weight, exp_avg, exp_avg_sq). Where each backend keeps them:
  DeepSpeed  the ZeRO partitions of the peft-wrapped module's trained parameters (``zero.py``'s
             reader; written in the universal layout, which every stage and DP size loads, with the
             tensors also in ``module`` for the LoRA load's check of exactly the trained names)
  megatron   torch_dist global tensors keyed by the HF-PEFT name (``adapters/megatron/lora.py``):
             a packed projection's B (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) as row blocks
             ``<name>.part<k>``; modules to save as megatron names them (``embedding.word_embeddings.
             weight`` with the vocabulary padded for the TP); the distributed optimizer's fp32 main
             weights and moments under ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from toolkit.formats.canonical import STATES, Source, TensorInfo, hf_config_object
from toolkit.formats.errors import ConvertError
from toolkit.layout import Layout
from toolkit.lora.geometry import QKV, megatron_sites
from toolkit.lora.peft import ADAPTER, PEFT_PREFIX, lora_layers, peft_config, peft_skeleton
from toolkit.lora.spec import LoraSpec

PART = ".part"
"""Suffix of a packed projection's B row block in a megatron LoRA checkpoint (``<B name>.part<k>``)."""


class LoraSource(Source):
    """The trained tensors of a LoRA checkpoint by peft parameter name: fp32, HF shapes, with Adam's
    moments when it has them; ``meta``: the checkpoint's meta.json (its ``lora`` spec and ``base_model``)."""

    def __init__(self, path: Path, format: str, hf_config: dict, tensors: dict[str, dict[str, torch.Tensor]],
                 meta: dict, **kw):
        super().__init__(path=path, format=format, hf_config=hf_config, **kw)
        self.tensors, self.meta = tensors, meta
        self.infos = {n: TensorInfo(tuple(t["param"].shape), torch.float32) for n, t in tensors.items()}
        self.has_optimizer = all("exp_avg" in t for t in tensors.values())

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        return self.tensors[name][state]

    def trained(self) -> dict[str, torch.Tensor]:
        return {n: t["param"] for n, t in self.tensors.items()}


# --- reading ------------------------------------------------------------------------------------------

def read_lora_checkpoint(ckpt: Path, meta: dict) -> LoraSource:
    """A toolkit LoRA checkpoint of either backend (``meta``: its meta.json)."""
    from toolkit.storage import meta as meta_io
    hf_config = meta_io.read_hf_config(ckpt)
    progress = meta_io.read_progress(ckpt)
    reader = _from_megatron if meta["format"] == "toolkit-megatron" else _from_zero
    tensors, extras = reader(ckpt, meta, hf_config)
    step = extras.pop("step", None)
    return LoraSource(ckpt, f"{meta['format']} (LoRA)", hf_config, tensors, meta, layout=meta.get("layout", {}),
                      step=progress.get("step", step), trainer_state=progress, **extras)


def _from_zero(ckpt: Path, meta: dict, hf_config: dict):
    from toolkit.formats.zero import UniversalSource, ZeroSource
    from toolkit.formats.zero_index import find_tag_dir
    tag = find_tag_dir(ckpt / "engine")
    if tag is None or meta["layout"].get("zero_stage", 0) == 0:
        raise ConvertError(f"{ckpt}: the ZeRO reader reads stages 1-3; this LoRA checkpoint was written at "
                           f"{meta['layout']}; use its run's adapter/ and hf_final/")
    universal = (tag / "zero" / "optimizer_state.pt").is_file()  # written by toolkit convert --to zero
    source = (UniversalSource if universal else ZeroSource)(tag, hf_config)
    try:
        tensors = {n: {s: source.read(n, s).float().clone() for s in STATES} for n in source.infos}
        return tensors, {"step": source.step, "optimizer_hparams": source.optimizer_hparams}
    finally:
        source.close()


def _from_megatron(ckpt: Path, meta: dict, hf_config: dict):
    """Each trained tensor (and its moments) from the torch_dist global tensors, strictly: every
    stored model tensor must be one of the spec's trained tensors."""
    from toolkit.formats.megatron import OPT_PREFIX, open_dist, read_region
    from toolkit.formats.safeload import safe_load
    engine = ckpt / "engine"
    reader, md = open_dist(engine)
    stored = {k for k, v in md.state_dict_metadata.items() if hasattr(v, "size") and not k.startswith("optimizer.")}
    keys = _storage_keys(hf_config, meta["lora"], stored)
    unused = sorted(stored - {k for ks in keys.values() for k in ks})
    if unused:
        raise ConvertError(f"{engine}: holds tensors that are not this LoRA spec's trained ones: {unused[:5]}")

    def read(key: str, state: str) -> torch.Tensor | None:
        name = (f"{OPT_PREFIX}param.{key}" if f"{OPT_PREFIX}param.{key}" in md.state_dict_metadata else key) \
            if state == "param" else f"{OPT_PREFIX}{state}.{key}"
        return read_region(reader, md, name).float() if name in md.state_dict_metadata else None

    tensors = {}
    for name, parts in keys.items():
        states = {s: [read(k, s) for k in parts] for s in STATES}
        tensors[name] = {s: _from_stored(name, ts, hf_config) for s, ts in states.items() if None not in ts}
    common = safe_load(engine / "common.pt", mmap=False) if (engine / "common.pt").is_file() else {}
    groups = common.get("optimizer", {}).get("optimizer", {}).get("param_groups", [])
    hparams = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if groups and k in groups[0]}
    return tensors, {"step": int(groups[0].get("step", 0)) if groups else None, "optimizer_hparams": hparams}


def _storage_keys(hf_config: dict, spec: dict, stored: set[str]) -> dict[str, list[str]]:
    """peft name -> the torch_dist keys that hold it (one; a packed B's row blocks in order)."""
    out = {}
    for name in _trained_names(hf_config, spec):
        if _is_saved(name):
            out[name] = [_saved_mcore(hf_config, name)]
        elif name in stored:
            out[name] = [name]
        else:
            parts = sorted((k for k in stored if k.startswith(name + PART)), key=lambda k: int(k.rsplit(PART, 1)[1]))
            out[name] = parts
        if not out[name] or not set(out[name]) <= stored:
            raise ConvertError(f"the megatron LoRA checkpoint lacks {name} (looked for {out[name] or name + PART + 'k'})")
    return out


def _from_stored(name: str, tensors: list[torch.Tensor], hf_config: dict) -> torch.Tensor:
    if _is_saved(name):  # megatron's vocabulary-padded embedding / head: the HF rows
        return tensors[0][:hf_config["vocab_size"]].contiguous()
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]


# --- names ----------------------------------------------------------------------------------------------

def meta_peft_model(hf_config: dict, config) -> torch.nn.Module:
    """peft's model of the base on the meta device (``lora/peft.py``'s skeleton); LoRA layers other
    than linear ones are refused."""
    try:
        model = peft_skeleton(hf_config_object(hf_config), config)
    except ValueError as exc:  # peft's "no module matched" and the like
        raise ConvertError(f"the adapter does not fit this base ({hf_config.get('model_type')}): {exc}") from None
    for name, module in lora_layers(model):
        if type(module).__name__ != "Linear":
            raise ConvertError(f"{name} is a LoRA {type(module).__name__} layer; toolkit convert merges LoRA on linear "
                               "layers only: merge this adapter with peft's merge_and_unload()")
    return model


def _trained_names(hf_config: dict, spec: dict) -> list[str]:
    """The peft parameter names a run with ``spec`` trains (peft's model of the base, meta device)."""
    model = meta_peft_model(hf_config, peft_config(LoraSpec(**spec)))
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _is_saved(name: str) -> bool:
    return f".modules_to_save.{ADAPTER}." in name


def _saved_mcore(hf_config: dict, name: str) -> str:
    """The megatron name of a module to save's trained tensor (the embedding, the LM head)."""
    from toolkit.families import find_family, table
    from toolkit.families.base import VOCAB
    hf = name.removeprefix(PEFT_PREFIX).replace(f".modules_to_save.{ADAPTER}.", ".")
    family = find_family(hf_config["model_type"])
    for mcore, (entry, _) in table(family, hf_config_object(hf_config), []).items():
        if entry.hf == hf and entry.split == VOCAB:  # as lora.geometry.megatron_saved allows
            return mcore
    raise ConvertError(f"{hf} is trained in full (lora.modules_to_save), which a megatron LoRA run does only for the "
                       f"embedding and the LM head ({family.model_type}); convert this checkpoint --to zero, peft or hf")


def _packed_rows(hf_config: dict, spec: dict) -> dict[str, list[int] | int]:
    """B name -> how megatron stores it in row blocks, for packed projections: the HF rows of q, k
    and v (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) or 2 equal halves (Phi-3's ``gate_up_proj``)."""
    from toolkit.families import find_family
    from toolkit.families.base import attention_dims
    cfg = hf_config_object(hf_config)
    heads, groups, head_dim = attention_dims(cfg)
    out = {}
    for site in megatron_sites(find_family(hf_config["model_type"]), cfg, LoraSpec(**spec), range(cfg.num_hidden_layers)):
        if site.parts > 1:
            b_name = f"{PEFT_PREFIX}{site.projections[0]}.lora_B.{ADAPTER}.weight"
            out[b_name] = [heads * head_dim, groups * head_dim, groups * head_dim] if site.kind == QKV else site.parts
    return out


def open_lora_checkpoint(path: Path) -> LoraSource:
    """The LoRA checkpoint at ``path`` (a run directory: its newest complete one)."""
    from toolkit.formats.detect import resolve_run_dir
    from toolkit.formats.lora_checkpoint import lora_checkpoint_meta
    return read_lora_checkpoint(*lora_checkpoint_meta(resolve_run_dir(Path(path))))


def read_located(found, base: str | None = None) -> LoraSource:
    """The table's ``lora_checkpoint`` of a toolkit LoRA checkpoint (``found``: where
    ``formats.detect.locate`` found it)."""
    from toolkit.storage.meta import read_meta
    return read_lora_checkpoint(found.path, read_meta(found.path))


def compare_lora_sources(a: LoraSource, b: LoraSource):
    """``--verify`` of a LoRA conversion to a backend: the same trained tensors, each weight (and
    Adam moment, where both have them) bit for bit, and the same step."""
    from toolkit.formats.report import Report
    report = Report()
    report.mismatched += [f"{n} (only in one)" for n in sorted(set(a.infos) ^ set(b.infos))]
    report.mismatched += [] if a.step == b.step else [f"step {a.step} != {b.step}"]
    for name in sorted(set(a.infos) & set(b.infos)):
        report.tensors += 1
        report.mismatched += [] if torch.equal(a.read(name), b.read(name)) else [name]
        for state in ("exp_avg", "exp_avg_sq") if a.has_optimizer and b.has_optimizer else ():
            report.moments += 1
            report.mismatched += [] if torch.equal(a.read(name, state), b.read(name, state)) else [f"{name}.{state}"]
    return report


# --- writing --------------------------------------------------------------------------------------------

def write_lora(source: LoraSource, stage: Path, *, layout: Layout, weights_only: bool) -> dict:
    """``stage/engine`` as a toolkit LoRA checkpoint of ``layout``'s backend saves it; returns the layout
    record for its description (``run.describe_for_resume`` adds meta.json's ``lora`` and ``base_model``)."""
    if layout.backend == "deepspeed":
        from toolkit.formats.zero import write_zero
        return write_zero(source, stage / "engine", layout=layout, weights_only=weights_only,
                          module_state=source.trained())
    return write_megatron_lora(source, stage / "engine", layout=layout, weights_only=weights_only)


def write_megatron_lora(source: LoraSource, engine_dir: Path, *, layout: Layout, weights_only: bool) -> dict:
    """``engine_dir`` as a megatron LoRA run at ``layout`` saves it (global tensors, any TP loads them;
    the vocabulary padded as ``layout`` pads it), the distributed optimizer's fp32 main weights and
    moments beside them; returns its layout record."""
    import torch.distributed.checkpoint as dcp

    from toolkit.formats.describe import megatron_description, write_megatron_description
    from toolkit.formats.megatron import OPT_PREFIX, _common, write_dist_metadata
    padded = layout.padded(source.hf_config["vocab_size"])
    moments = source.has_optimizer and not weights_only
    rows = _packed_rows(source.hf_config, source.meta["lora"])
    state = {}
    for name in source.names():
        for key, tensors in _as_stored(source, name, rows, padded).items():
            state[key] = tensors["param"]
            if moments:
                state.update({f"{OPT_PREFIX}{s}.{key}": tensors[s] for s in STATES})
    engine_dir.mkdir(parents=True)
    writer = dcp.FileSystemWriter(str(engine_dir), single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)
    write_dist_metadata(engine_dir)
    torch.save(_common(source, moments), engine_dir / "common.pt")
    record = layout.record()
    write_megatron_description(engine_dir, megatron_description(source.model_type, source.hf_config["vocab_size"],
                                                                padded, layout.vocab_divisor, record, lora=True))
    return record


def _as_stored(source: LoraSource, name: str, rows: dict[str, list[int]], padded: int) -> dict[str, dict]:
    """torch_dist key -> {state: tensor} of one trained tensor, as megatron stores it."""
    states = {s: source.read(name, s) for s in STATES if s == "param" or source.has_optimizer}
    if _is_saved(name):
        def pad(t):
            return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]).contiguous()
        return {_saved_mcore(source.hf_config, name): {s: pad(t) for s, t in states.items()}}
    if name in rows:
        split = {s: torch.split(t, rows[name]) if isinstance(rows[name], list) else torch.chunk(t, rows[name])
                 for s, t in states.items()}
        return {f"{name}{PART}{k}": {s: split[s][k].contiguous() for s in states} for k in range(len(split["param"]))}
    return {name: {s: t.contiguous() for s, t in states.items()}}
