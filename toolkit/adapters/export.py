"""``hf_final/`` written tensor by tensor, with the converter's HF writer, from a running engine.

An engine's weights are a ``formats.canonical.Source`` (HF checkpoint names, full fp32 tensors read
one at a time): ``ModuleSource`` for an HF module (DeepSpeed; under ZeRO-3 each read gathers one
parameter), ``adapters/megatron/export.py`` for megatron chunks. Reads are collective: every rank
reads every name in the same order; rank 0 writes (``formats/hf.py``'s writer, the converter's own:
same names, sharding and index), so no rank holds more than one parameter beyond its own share.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.formats.canonical import Source, TensorInfo
from toolkit.heap import trim_heap
from toolkit.lora.quant import dense, dense_shape


class ModuleSource(Source):
    """An HF module's parameters under their checkpoint names (transformers' packed MoE experts as
    one tensor per expert, a tied output embedding once), read whole; ``gather(param)``: a context
    in which the parameter is whole on every rank (ZeRO-3), None when it already is."""

    def __init__(self, module: torch.nn.Module, model_type: str, gather=None):
        from toolkit.families import find_family, unpacked_layout
        config = module.config
        super().__init__(path=Path("."), format="engine", hf_config=fp32_config(config))
        self.params = self._hf_params(module)
        shapes = {n: dense_shape(p) for n, p in self.params.items()}  # a 4-bit weight: its [out, in]
        self.unpacked = unpacked_layout(find_family(model_type), config, shapes)
        self.infos = {n: TensorInfo(piece.shape, torch.float32) for n, piece in self.unpacked.items()}
        self.gather = gather
        self.collective = gather is not None  # reads gather on every rank; else rank 0 reads alone
        self._cached: tuple[str, torch.Tensor] | None = None

    def _hf_params(self, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return dict(module.named_parameters())

    def read(self, name: str, state: str = "param") -> torch.Tensor | None:
        piece = self.unpacked[name]
        whole = self._whole(piece.module)
        return None if whole is None else whole.reshape(-1)[piece.start:piece.start + piece.numel].view(piece.shape)

    def _whole(self, param_name: str) -> torch.Tensor | None:
        """The parameter in fp32 on the CPU, on rank 0 (kept until another is asked for: a packed MoE
        parameter serves one checkpoint tensor per expert in a row); the other ranks only take part
        in the gather."""
        if self._cached is None or self._cached[0] != param_name:
            self._cached = None
            trim_heap()  # the previous tensor's pages back to the OS (toolkit/heap.py: else RSS grows)
            whole = self._gathered_fp32(param_name)
            self._cached = (param_name, whole)
        return self._cached[1]

    def _gathered_fp32(self, param_name: str) -> torch.Tensor | None:
        """The parameter whole, in fp32 on the CPU, on rank 0; None on the others."""
        param = self.params[param_name]
        with self.gather(param) if self.gather else contextlib.nullcontext():
            return dense(param).to("cpu", torch.float32).clone() if dist.get_rank() == 0 else None


class MergedLoraSource(ModuleSource):
    """A peft-wrapped module (``lora/peft.py``'s ``apply_lora``) as the merged HF model, for a base that exists
    only in the module (a random init): each adapted layer's weight is W + scaling x B @ A in fp32
    on rank 0, W gathered from the module (one layer at a time under ZeRO-3), A and B from
    ``trained``; a module trained in full (modules_to_save) is its trained copy. ``trained``: the
    fp32 trained tensors by peft name (``trained_fp32``) on rank 0, None on the others."""

    def __init__(self, module: torch.nn.Module, model_type: str, trained: dict | None, gather=None):
        from toolkit.lora.convert import merge_table
        super().__init__(module, model_type, gather=gather)
        self.pairs, self.saved = merge_table(module, trained) if trained is not None else ({}, {})

    def _hf_params(self, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        from toolkit.lora.peft import hf_name
        return {hf: param for name, param in module.named_parameters() if (hf := hf_name(name)) is not None}

    def _gathered_fp32(self, param_name: str) -> torch.Tensor | None:
        from toolkit.lora.peft import merged_weight
        whole = super()._gathered_fp32(param_name)  # collective under ZeRO-3: every rank asks
        if whole is None:
            return None
        if param_name in self.saved:
            return self.saved[param_name]
        return merged_weight(whole, *self.pairs[param_name]) if param_name in self.pairs else whole


def trained_fp32(module: torch.nn.Module, gather=None) -> dict[str, torch.Tensor] | None:
    """Collective: what a LoRA run trains, by peft name, whole in fp32 on the CPU of rank 0 (None on
    the others): DeepSpeed's fp32 master copies where its optimizer keeps them (bf16/fp16 runs hold
    rounded copies in the module; ``safe_get_full_fp32_param`` gathers the masters at any stage),
    else the parameter itself."""
    from deepspeed.utils import safe_get_full_fp32_param

    from toolkit.lora.peft import trainable_names
    params, out = dict(module.named_parameters()), {}
    for name in trainable_names(module):  # every rank, same order: the gathers are collective
        master = safe_get_full_fp32_param(params[name])
        if master is None:
            with gather(params[name]) if gather else contextlib.nullcontext():
                master = params[name].detach()
        if dist.get_rank() == 0:
            out[name] = master.detach().to("cpu", torch.float32).clone()
    return out if dist.get_rank() == 0 else None


def write_merged(module: torch.nn.Module, trained: dict | None, path: Path, tokenizer, generation_config,
                 gather=None, base: str | None = None, beat=None) -> None:
    """Collective: ``hf_final/`` of a LoRA run, merged in fp32. A pretrained ``base`` is read from
    its files by rank 0 (the converter's HF reader), so a bf16 or fp16 run does not round the frozen
    weights it never changed; a random-init base exists only in the module (``MergedLoraSource``)."""
    if base is None:
        write_streamed(MergedLoraSource(module, module.config.model_type, trained, gather), path, tokenizer,
                       generation_config, beat=beat)
        return
    if dist.get_rank() != 0:
        write_streamed(None, path)
        return
    from toolkit.formats.hf import HFSource
    from toolkit.lora.convert import merged_source
    reader = HFSource(Path(base))
    try:
        write_streamed(merged_source(reader, module, trained), path, tokenizer, generation_config, beat=beat)
    finally:
        reader.close()


def write_adapter(module: torch.nn.Module, path: Path, trained: dict | None, base_name: str | None = None,
                  quantization=None) -> None:
    """Collective: the trained adapter of a peft-wrapped ``module`` as an HF-PEFT directory
    (``adapter_config.json``, ``adapter_model.safetensors`` in fp32, peft's own key names), which
    ``peft.PeftModel.from_pretrained(base, path)`` loads; rank 0 writes ``trained`` (``trained_fp32``),
    replaced whole. ``quantization``: the run config of a 4-bit base, whose ``BitsAndBytesConfig`` is
    written beside the adapter (``bnb_config.json``: how to quantize the base the adapter trained on)."""
    if dist.get_rank() == 0:
        _write_peft_dir(module, trained, Path(path), base_name, quantization)
    dist.barrier()


def _write_peft_dir(module, trained: dict[str, torch.Tensor], path: Path, base_name: str | None,
                    quantization=None) -> None:
    """The HF-PEFT directory staged beside ``path``, then put in its place whole."""
    from toolkit.lora.convert import save_peft
    from toolkit.lora.quant import BNB_CONFIG_FILE, bnb_config, quantized
    with _replaced_whole(path) as stage:
        save_peft(module, trained, stage, base_name)
        if quantization is not None and quantized(quantization):
            (stage / BNB_CONFIG_FILE).write_text(bnb_config(quantization).to_json_string())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(stage / "adapter_model.safetensors", 0o666 & ~umask)  # safetensors writes 0600 (a temporary file)


@contextlib.contextmanager
def _replaced_whole(path: Path):
    """A fresh directory beside ``path`` to build in; once built, it replaces ``path`` (a resumed
    run that had finished exports again) in one rename. A failed build leaves ``path`` as it was."""
    stage = path.with_name(f".{path.name}.writing-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    yield stage
    if path.exists():
        shutil.rmtree(path)
    os.replace(stage, path)

def fp32_config(config) -> dict:
    """config.json as written next to fp32 tensors (mixed precision changed the module's dtype)."""
    out = json.loads(config.to_json_string(use_diff=False))
    out["dtype"] = "float32"
    return out


def _beating(source: Source, beat) -> Source:
    """``source`` whose ``read`` beats after each tensor (an attribute of this instance only)."""
    read = source.read

    def read_and_beat(name, state="param"):
        tensor = read(name, state)
        beat()
        return tensor
    source.read = read_and_beat
    return source


@contextlib.contextmanager
def _drained_on_failure(source: Source):
    """If rank 0's writing fails (a full disk), it still makes the reads the other ranks are waiting
    in, so they finish with it instead of hanging until the process-group timeout; then it raises."""
    names, done = list(source.infos), [0]
    read = source.read

    def counted(name, state="param"):
        done[0] += 1
        return read(name, state)
    source.read = counted
    try:
        yield
    except BaseException:
        if source.collective:
            for name in names[done[0]:]:
                read(name)
        dist.barrier()
        raise
    finally:
        source.read = read


def write_streamed(source: Source | None, path: Path, tokenizer=None, generation_config=None, beat=None) -> None:
    """Collective: every rank reads every tensor in the writer's order (a source rank 0 reads alone,
    ``collective`` False, may be None on the others); rank 0 writes ``path`` (replaced whole: built
    beside it, then renamed). ``beat()`` after each tensor read (the heartbeat's progress)."""
    path = Path(path)
    if beat is not None and source is not None:
        source = _beating(source, beat)
    if dist.get_rank() != 0:
        for name in source.infos if source is not None and source.collective else ():  # the writer's order
            source.read(name)
        dist.barrier()
        return
    from toolkit.formats.hf import write_hf
    with _replaced_whole(path) as stage:
        with _drained_on_failure(source):
            write_hf(source, stage)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(stage))
        if generation_config is not None:
            generation_config.save_pretrained(str(stage))
    dist.barrier()
