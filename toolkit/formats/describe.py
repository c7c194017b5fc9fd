"""What a checkpoint says of itself, in one place each, read and written without torch:

  ``layout_record``        the parallel layout a checkpoint was written at (``Layout.record()``: the
                           dict meta.json, the universal ZeRO layout and ``toolkit_megatron.json``
                           carry, and that resume compares)
  ``megatron_description`` ``toolkit_megatron.json`` beside a torch_dist checkpoint (true vocab,
                           padded vocab and its divisor, layer spec, layout), written and read by
                           ``write_megatron_description`` / ``read_megatron_description``
  ``find_dist_dir`` / ``find_legacy_dir`` / ``find_dcp_dir`` / ``find_accelerate_dir`` /
  ``find_torchtitan_dir``  where a megatron, PyTorch DCP, accelerate or torchtitan checkpoint lies
                           (its own markers)
  ``describe_*``           each format's layout record, read back from a checkpoint (the table's
                           ``describe``)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from toolkit.formats.errors import ConvertError
from toolkit.layout import Layout

MEGATRON_DESCRIPTION = "toolkit_megatron.json"
LEGACY_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
"""Megatron-LM's legacy rank folders: ``mp_rank_{tp:02d}[_{pp:03d}]``."""
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
"""``FileSystemWriter``'s data files: ``__{rank}_{file index}.distcp``."""
ACCELERATE_MODEL, ACCELERATE_OPTIM = "pytorch_model_fsdp_0", "optimizer_0"
"""The DCP directories accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` write in an HF Trainer
``checkpoint-N/`` (model index 0, optimizer index 0)."""


def layout_record(backend: str, dp: int, tp: int = 1, pp: int = 1, ep: int = 1, zero_stage: int = 0) -> dict:
    """The record of a layout a reader found by its sizes, as ``Layout.record()`` writes it."""
    return Layout.of_sizes(backend, dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=zero_stage).record()


def megatron_description(family: str, vocab_size: int, padded_vocab: int, vocab_divisor: int, layout: dict,
                         lora: bool = False) -> dict:
    """``toolkit_megatron.json``: what a reader of a torch_dist checkpoint needs beyond its tensors."""
    return {"format": "megatron-core torch_dist", "family": family, "vocab_size": vocab_size,
            "padded_vocab_size": padded_vocab, "make_vocab_size_divisible_by": vocab_divisor,
            "layer_spec": "gpt_layer_local_spec", "optimizer_sharding": "fully_reshardable", "layout": layout,
            **({"lora": "adapters only, HF-PEFT names"} if lora else {})}


def write_megatron_description(engine_dir: Path, description: dict) -> None:
    (Path(engine_dir) / MEGATRON_DESCRIPTION).write_text(json.dumps(description, indent=2))


def read_megatron_description(engine_dir: Path) -> dict:
    """The description beside a torch_dist checkpoint; {} for one written without it (megatron's own)."""
    path = Path(engine_dir) / MEGATRON_DESCRIPTION
    return json.loads(path.read_text()) if path.is_file() else {}


# --- where a megatron checkpoint lies -------------------------------------------------------------------

def find_dist_dir(path: Path) -> Path | None:
    """A megatron-core ``torch_dist`` checkpoint: the folder (or its ``engine/``) with its metadata.json."""
    for cand in (path, path / "engine"):
        meta = cand / "metadata.json"
        if meta.is_file():
            try:
                if json.loads(meta.read_text()).get("sharded_backend") == "torch_dist":
                    return cand
            except ValueError:
                raise ConvertError(f"{meta}: not valid JSON; the checkpoint is damaged") from None
    return None


def find_legacy_dir(path: Path) -> Path | None:
    """Megatron-LM's ``iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt`` (the folder holding them)."""
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = tracker.read_text().strip()
        if it != "release" and not it.isdigit():  # an iteration number: never a path to follow
            raise ConvertError(f"{tracker} holds {it[:200]!r}, not an iteration number or 'release'; the checkpoint "
                               "is damaged: write the newest iteration into it, or convert an intact copy")
        path = path / ("release" if it == "release" else f"iter_{int(it):07d}")
    if any(path.glob("mp_rank_*/model_optim_rng.pt")):
        return path
    return None


def find_dcp_dir(path: Path) -> Path | None:
    """A DCP directory: ``.metadata`` beside ``__R_N.distcp`` files (torch-free: the table's detector)."""
    if path.is_dir() and (path / ".metadata").is_file() and any(DATA_FILE.match(p.name) for p in path.iterdir()):
        return path
    return None


TITAN_MARKER = b"tok_embeddings.weight"
"""torchtitan's name of the input embedding (every torchtitan decoder's): its checkpoints' mark."""


def find_torchtitan_dir(path: Path) -> Path | None:
    """A torchtitan checkpoint (``step-N/``): a DCP directory whose model keys are torchtitan's, told
    by the embedding's name among the ``.metadata`` pickle's strings (read as bytes, never unpickled)."""
    if find_dcp_dir(path) is None or not (path / ".metadata").stat().st_size:
        return None
    import mmap
    with open(path / ".metadata", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return path if m.find(TITAN_MARKER) >= 0 else None


def find_accelerate_dir(path: Path) -> Path | None:
    """An accelerate / HF Trainer FSDP checkpoint (sharded state dict): ``checkpoint-N/`` holding a
    DCP ``pytorch_model_fsdp_0/`` (and ``optimizer_0/``)."""
    return path if path.is_dir() and find_dcp_dir(path / ACCELERATE_MODEL) else None


# --- each format's layout record, read back -----------------------------------------------------------

def describe_hf(path: Path) -> dict:
    """An HF directory holds whole tensors: no parallel layout."""
    return {}


def describe_zero(tag_dir: Path) -> dict:
    """A native ZeRO checkpoint: its stage (in the optimizer states) and DP size (their files)."""
    from toolkit.formats.safeload import safe_load
    from toolkit.formats.zero_index import optim_files
    files = optim_files(tag_dir)
    stage = int(safe_load(files[0])["optimizer_state_dict"]["zero_stage"])
    return layout_record("deepspeed", dp=len(files), zero_stage=stage)


def describe_zero_universal(tag_dir: Path) -> dict:
    """DeepSpeed's universal layout: the layout recorded in ``zero/optimizer_state.pt``."""
    from toolkit.formats.safeload import safe_load
    return universal_layout(safe_load(tag_dir / "zero" / "optimizer_state.pt", mmap=False).get("toolkit", {}))


def universal_layout(toolkit_meta: dict) -> dict:
    """The layout in the ``toolkit`` entry of a universal ``zero/optimizer_state.pt`` (DP 1, stage 0
    when absent: DeepSpeed's ``ds_to_universal`` writes none)."""
    if "layout" in toolkit_meta:
        return dict(toolkit_meta["layout"])
    return layout_record("deepspeed", dp=1, zero_stage=0)


def describe_megatron(engine_dir: Path) -> dict:
    return dict(read_megatron_description(engine_dir).get("layout", {}))


def describe_megatron_legacy(path: Path) -> dict:
    """TP and PP from the rank folders' names."""
    ranks = [(int(m.group(1)), int(m.group(2) or 0)) for d in path.iterdir() if (m := LEGACY_RE.match(d.name))]
    return {"tp": 1 + max(t for t, _ in ranks), "pp": 1 + max(p for _, p in ranks)}


def describe_dcp(path: Path) -> dict:
    """The number of ranks that wrote it (the FSDP data-parallel size), from the data files' names."""
    return {"dp": len({DATA_FILE.match(p.name).group(1) for p in path.iterdir() if DATA_FILE.match(p.name)})}


def describe_torchtitan(path: Path) -> dict:
    """Its writer ranks, as any DCP directory's."""
    return describe_dcp(path)


def describe_accelerate(path: Path) -> dict:
    """The number of ranks that wrote its model directory."""
    return describe_dcp(path / ACCELERATE_MODEL)
