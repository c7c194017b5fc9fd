"""The canonical stream between every reader and every writer.

A ``Source`` answers, by HF name, for the *full* tensor of a parameter (fp32, the HF layout and
shape) and, when the checkpoint holds them, its Adam moments ``exp_avg`` / ``exp_avg_sq`` (same
shape). Readers serve one tensor at a time from memory-mapped files or byte ranges, so a writer
that pulls names one by one holds a few tensors at most, never the model. ``stream`` turns a
source into the one-way stream of ``Record``s.

Names are the HF model's ``state_dict`` names, except that a model with tied embeddings has no
``lm_head.weight`` entry (it *is* the input embedding).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from toolkit.layout import Layout

if TYPE_CHECKING:  # annotations only: the direct ZeRO -> HF route (direct.py) runs without torch
    import torch

STATES = ("param", "exp_avg", "exp_avg_sq")
"""What a source can hold per parameter: the fp32 weight and Adam's first and second moments."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class Record:
    """One parameter in the stream: full tensor, optional moments, the optimizer step."""
    name: str
    param: torch.Tensor
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    step: int | None = None


@dataclass
class Source:
    """Base of every reader. Subclasses fill ``infos`` (HF name -> TensorInfo, in model order) and
    implement ``read(name, state)``."""
    path: Path
    format: str
    hf_config: dict
    """The HF ``config.json`` as a dict (what a writer carries over)."""
    infos: dict[str, TensorInfo] = field(default_factory=dict)
    step: int | None = None
    has_optimizer: bool = False
    layout: dict = field(default_factory=dict)
    carry_files: list[Path] = field(default_factory=list)
    """Files copied next to an HF output unchanged (tokenizer, generation config)."""
    trainer_state: dict | None = None
    """The toolkit's trainer.json when SRC is a toolkit checkpoint (step, consumed samples, seed)."""
    optimizer_hparams: dict = field(default_factory=dict)
    """lr, betas, eps, weight_decay of the source optimizer (first param group), when known."""
    vocab_divisor: int | None = None
    """megatron.make_vocab_size_divisible_by a megatron source was written with, when recorded."""

    def names(self) -> list[str]:
        return list(self.infos)

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    @property
    def model_type(self) -> str | None:
        return self.hf_config.get("model_type")

    @property
    def tied(self) -> bool:
        """Input and output embeddings are one tensor (the class default applies when the key is absent)."""
        if "tie_word_embeddings" in self.hf_config:
            return bool(self.hf_config["tie_word_embeddings"])
        return bool(hf_config_object(self.hf_config).tie_word_embeddings)

    def num_params(self) -> int:
        return sum(i.nbytes // i.dtype.itemsize for i in self.infos.values())


@dataclass(frozen=True)
class WriteRequest:
    """What a writer is asked for (``Format.write``): the layout of the output (its sizes, ZeRO stage
    and megatron's vocabulary divisor: the run that resumes it pads its vocabulary so), its dtype
    (None: the source's), whether Adam's moments are left out, HF shard size. Each writer reads what
    concerns its format."""
    layout: Layout = field(default_factory=lambda: Layout.of_sizes("deepspeed", dp=1, zero_stage=2))
    dtype: torch.dtype | None = None
    weights_only: bool = False
    max_shard_bytes: int = 5 << 30


def stream(source: Source, weights_only: bool = False) -> Iterator[Record]:
    """Records in model order, one full tensor (and its moments) at a time."""
    moments = source.has_optimizer and not weights_only
    for name in source.names():
        yield Record(name, source.read(name, "param"),
                     source.read(name, "exp_avg") if moments else None,
                     source.read(name, "exp_avg_sq") if moments else None,
                     source.step)


def hf_config_object(config: dict):
    """A transformers config from the dict (imported lazily: only paths that need the family do)."""
    from transformers import AutoConfig
    kw = dict(config)
    return AutoConfig.for_model(kw.pop("model_type"), **{k: v for k, v in kw.items() if k != "architectures"})


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
