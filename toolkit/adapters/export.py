"""``hf_final/`` written tensor by tensor, with the converter's HF writer, from a running engine.

An engine's weights are a ``convert.canonical.Source`` (HF checkpoint names, full fp32 tensors read
one at a time): ``ModuleSource`` for an HF module (DeepSpeed; under ZeRO-3 each read gathers one
parameter), ``adapters/megatron/export.py`` for megatron chunks. Reads are collective: every rank
reads every name in the same order; rank 0 writes (``convert/hf.py``'s writer, the converter's own:
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

from toolkit.convert.canonical import Source, TensorInfo
from toolkit.convert.pages import trim_heap


class ModuleSource(Source):
    """An HF module's parameters under their checkpoint names (transformers' packed MoE experts as
    one tensor per expert, a tied output embedding once), read whole; ``gather(param)``: a context
    in which the parameter is whole on every rank (ZeRO-3), None when it already is."""

    def __init__(self, module: torch.nn.Module, model_type: str, gather=None):
        from toolkit.families import find_family, unpacked_layout
        config = module.config
        super().__init__(path=Path("."), format="engine", hf_config=fp32_config(config))
        self.params = dict(module.named_parameters())
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in self.params.items()}
        self.unpacked = unpacked_layout(find_family(model_type), config, shapes)
        self.infos = {n: TensorInfo(piece.shape, torch.float32) for n, piece in self.unpacked.items()}
        self.gather = gather
        self.collective = gather is not None  # reads gather on every rank; else rank 0 reads alone
        self._cached: tuple[str, torch.Tensor] | None = None

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
            trim_heap()  # the previous tensor's pages back to the OS (convert/pages.py: else RSS grows)
            param = self.params[param_name]
            with self.gather(param) if self.gather else contextlib.nullcontext():
                if dist.get_rank() == 0:
                    self._cached = (param_name, param.detach().to("cpu", torch.float32).clone())
            if self._cached is None:
                self._cached = (param_name, None)
        return self._cached[1]


def fp32_config(config) -> dict:
    """config.json as written next to fp32 tensors (mixed precision changed the module's dtype)."""
    out = json.loads(config.to_json_string(use_diff=False))
    out["dtype"] = "float32"
    return out


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


def write_streamed(source: Source, path: Path, tokenizer=None, generation_config=None) -> None:
    """Collective: every rank reads every tensor in the writer's order; rank 0 writes ``path``
    (replaced whole: built beside it, then renamed)."""
    path = Path(path)
    if dist.get_rank() != 0:
        for name in source.infos if source.collective else ():  # rank 0's writer reads in this order
            source.read(name)
        dist.barrier()
        return
    from toolkit.convert.hf import write_hf
    stage = path.with_name(f".{path.name}.writing-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    with _drained_on_failure(source):
        write_hf(source, stage)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(stage))
    if generation_config is not None:
        generation_config.save_pretrained(str(stage))
    if path.exists():  # a resumed run that had finished exports again
        shutil.rmtree(path)
    os.replace(stage, path)
    dist.barrier()
