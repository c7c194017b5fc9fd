"""PyTorch distributed checkpoints (DCP) of an FSDP2 model with HF parameter names: read (plain
``dcp.save`` and accelerate's / HF Trainer's ``checkpoint-N/``).

The layout read here is what ``torch.distributed.checkpoint.save`` writes for
``{"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}``
(``torch.distributed.checkpoint.state_dict``) at any number of writer ranks: a directory of
``__{rank}_{n}.distcp`` files and one ``.metadata``, whose keys are the flattened state dict:
  ``model.<HF name>``                          the weights (each a global tensor, chunked by rank)
  ``optim.state.<HF name>.{exp_avg,exp_avg_sq,step}``   AdamW's state, keyed by parameter name
  ``optim.param_groups.<g>.{lr,betas,eps,weight_decay,params,...}``  hyperparameters (pickled bytes)

Tensors are read one at a time through DCP's own ``FileSystemReader`` (each from whatever chunks
the ranks wrote; DCP itself loads them with ``torch.load(weights_only=True)``). The ``.metadata``
pickle is read by ``dcp_metadata.load_metadata``'s allowlist, never by DCP's ``pickle.load``, and
the few pickled hyperparameters with ``weights_only=True``: nothing in the directory runs code.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch

from toolkit.formats.canonical import Source, TensorInfo, hf_config_object
from toolkit.formats.dcp_metadata import load_metadata
from toolkit.formats.describe import ACCELERATE_MODEL, ACCELERATE_OPTIM, describe_dcp
from toolkit.formats.errors import ConvertError
from toolkit.formats.megatron import read_region
from toolkit.formats.safeload import refused_global

ADAM_STATE = {"exp_avg", "exp_avg_sq", "step"}
HPARAMS = ("lr", "betas", "eps", "weight_decay")
class DCPSource(Source):
    """An FSDP2 model's DCP checkpoint (HF names); weights, AdamW moments and step, tensor by tensor.

    ``model`` / ``optim``: the directories of the model and the optimizer state dicts (one for a plain
    save, two for accelerate's) and the top-level keys they were saved under."""

    model_key, optim_key = "model", "optim"

    def __init__(self, path: Path, hf_config: dict, format: str = "dcp", **kw):
        super().__init__(path=path, format=format, hf_config=hf_config, **kw)
        model_dir, optim_dir = self.dirs(path)
        self._model = _Part(model_dir)
        self._optim = self._model if optim_dir == model_dir else _Part(optim_dir) if optim_dir else None
        self.model_prefix = f"{self.model_key}." if self.model_key else ""  # torchtitan: top-level names
        self.state_prefix = f"{self.optim_key}.state."
        self.groups_prefix = f"{self.optim_key}.param_groups."
        self.infos = self._model_infos(self._model.tensors())
        self._check_names()
        optim = self._optim.tensors() if self._optim else {}
        self.has_optimizer = self._check_optimizer(optim)
        self.step = self._step(optim) if self.has_optimizer else None
        self.optimizer_hparams = self._hparams() if self._optim else {}
        self.layout = describe_dcp(model_dir)

    def dirs(self, path: Path) -> tuple[Path, Path | None]:
        """(model directory, optimizer directory or None)."""
        return path, path

    # --- what the checkpoint holds -----------------------------------------------------------------

    def _model_infos(self, tensors: dict) -> dict[str, TensorInfo]:
        infos = {k[len(self.model_prefix):]: TensorInfo(tuple(v.size), v.properties.dtype)
                 for k, v in tensors.items() if k.startswith(self.model_prefix)}
        if not infos:
            raise ConvertError(f"{self._model.dir}: no '{self.model_prefix}*' tensors; expected a DCP checkpoint saved "
                               f"as {{'{self.model_key}': get_model_state_dict(model), '{self.optim_key}': "
                               "get_optimizer_state_dict(model, opt)}")
        if self.tied:
            infos.pop("lm_head.weight", None)  # the input embedding itself (canonical names)
        return infos

    def _check_names(self) -> None:
        """Exactly the HF model's parameters with its shapes (a meta-device model of the config)."""
        from toolkit.families.meta import meta_model
        model = meta_model(hf_config_object(self.hf_config))
        want = {n: tuple(t.shape) for n, t in model.state_dict().items()
                if not (self.tied and n == "lm_head.weight")}
        missing, unknown = sorted(set(want) - set(self.infos)), sorted(set(self.infos) - set(want))
        wrong = sorted(n for n in set(want) & set(self.infos) if want[n] != self.infos[n].shape)
        if missing or unknown or wrong:
            raise ConvertError(f"{self.path}: the model tensors are not the HF {self.model_type} model's (wrong "
                               f"--hf-config, or names other than HF's?): missing {missing[:6]}, unknown "
                               f"{unknown[:6]}, wrong shapes {wrong[:6]}")

    def _check_optimizer(self, tensors: dict) -> bool:
        """AdamW state or none; another optimizer's state is refused by its keys."""
        kinds = {k[len(self.state_prefix):].rpartition(".")[2] for k in tensors if k.startswith(self.state_prefix)}
        if not kinds:
            return False
        if not kinds <= ADAM_STATE or "exp_avg" not in kinds:
            raise ConvertError(f"{self.path}: optimizer state {sorted(kinds)} is not Adam/AdamW's (exp_avg, "
                               "exp_avg_sq, step); only Adam/AdamW state converts (or pass --weights-only)")
        return True

    def _step(self, tensors: dict) -> int | None:
        steps = [k for k in tensors if k.startswith(self.state_prefix) and k.endswith(".step")]
        return int(self._optim.tensor(steps[0]).item()) if steps else None

    def _hparams(self) -> dict:
        keys = {k: f"{self.groups_prefix}0.{k}" for k in HPARAMS}
        found = {k: key for k, key in keys.items() if key in self._optim.md.state_dict_metadata}
        return {k: self._optim.bytes(key) for k, key in found.items()}

    # --- data --------------------------------------------------------------------------------------

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        if state == "param":
            return self._model.tensor(self.model_prefix + name)
        key = f"{self.state_prefix}{name}.{state}"
        if key not in self._optim.md.state_dict_metadata:  # a frozen parameter: no optimizer state
            return torch.zeros(self.infos[name].shape, dtype=torch.float32)
        return self._optim.tensor(key)


class AccelerateSource(DCPSource):
    """accelerate's / HF Trainer's FSDP checkpoint (``SHARDED_STATE_DICT``): ``checkpoint-N/`` with
    ``pytorch_model_fsdp_0/`` (DCP of ``{"model": get_model_state_dict(model)}``) and ``optimizer_0/``
    (DCP of ``{"optimizer": get_optimizer_state_dict(model, opt)}``), as ``save_fsdp_model`` /
    ``save_fsdp_optimizer`` write them; without ``optimizer_0/`` (``save_only_model``) weights only."""

    model_key, optim_key = "model", "optimizer"

    def __init__(self, path: Path, hf_config: dict, **kw):
        super().__init__(path, hf_config, format="accelerate", **kw)

    def dirs(self, path: Path) -> tuple[Path, Path | None]:
        optim = path / ACCELERATE_OPTIM
        return path / ACCELERATE_MODEL, optim if (optim / ".metadata").is_file() else None


TITAN_STATES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")
"""Top-level keys of a torchtitan checkpoint besides the model's (``CheckpointManager``'s states)."""
TITAN_STEP = re.compile(r"step-(\d+)$")


class TorchtitanSource(DCPSource):
    """A torchtitan checkpoint (``step-N/``): a DCP of the model's state dict flattened to the top
    level under torchtitan's own names, ``optimizer.state.<name>.{exp_avg,exp_avg_sq,step}`` and
    ``optimizer.param_groups.<name>.<hparam>`` (its flat optimizer state dict), ``lr_scheduler``,
    ``dataloader`` and ``train_state`` (step, tokens seen); a model-only save (``last_save_model_only``)
    holds the weights alone. Names map to HF's through the family's ``torchtitan`` table, and Llama 3's
    q/k rows (and their moments) from torchtitan's interleaved RoPE layout to HF's."""

    model_key, optim_key = "", "optimizer"

    def __init__(self, path: Path, hf_config: dict, **kw):
        from toolkit.families import find_family
        family = find_family(hf_config.get("model_type"))
        if family is None or family.torchtitan is None:
            from toolkit.families import supported
            titan = [t for t in supported() if find_family(t).torchtitan]
            raise ConvertError(f"{path}: a torchtitan checkpoint, but the HF config's model_type "
                               f"{hf_config.get('model_type')!r} has no torchtitan names; torchtitan's models "
                               f"that convert: {titan} (pass --hf-config with the matching HF config.json)")
        self.family = family
        self._titan: dict[str, str] = {}  # HF name -> torchtitan name
        super().__init__(path, hf_config, format="torchtitan", **kw)
        if self.step is None:  # model only: the step its folder is named after
            found = TITAN_STEP.match(Path(path).name)
            self.step = int(found.group(1)) if found else None

    def _model_infos(self, tensors: dict) -> dict[str, TensorInfo]:
        names = self.family.torchtitan
        infos, unknown = {}, []
        for key, meta in tensors.items():
            if key.startswith(TITAN_STATES):
                continue
            hf = names.hf_name(key, self.family.hf_layer)
            if hf is None:
                unknown.append(key)
                continue
            self._titan[hf] = key
            infos[hf] = TensorInfo(tuple(meta.size), meta.properties.dtype)
        if unknown:
            raise ConvertError(f"{self.path}: torchtitan names {sorted(unknown)[:6]} are not in the {self.model_type} "
                               f"family's torchtitan table (toolkit/families/{self.model_type}.py); a torchtitan model "
                               "other than its Llama 3 / Qwen 3 (dense), or the wrong --hf-config")
        if not infos:
            raise ConvertError(f"{self.path}: no model tensors in this torchtitan checkpoint")
        if self.tied:
            infos.pop("lm_head.weight", None)
        return infos

    def _hparams(self) -> dict:
        first = next(iter(self._titan.values()))
        keys = {k: f"{self.groups_prefix}{first}.{k}" for k in HPARAMS}
        return {k: self._optim.bytes(key) for k, key in keys.items() if key in self._optim.md.state_dict_metadata}

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        titan = self._titan[name]
        if state == "param":
            x = self._model.tensor(titan)
        else:
            key = f"{self.state_prefix}{titan}.{state}"
            if key not in self._optim.md.state_dict_metadata:
                return torch.zeros(self.infos[name].shape, dtype=torch.float32)
            x = self._optim.tensor(key)
        if state == "step":
            return x
        head_dim = self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.hf_config["num_attention_heads"]
        return self.family.torchtitan.to_hf(name, x, head_dim)


class _Part:
    """One DCP directory: its vetted metadata and DCP's own reader over it."""

    def __init__(self, folder: Path):
        from torch.distributed.checkpoint import FileSystemReader
        self.dir = Path(folder)
        self.md = load_metadata(folder)
        self._check_files()
        self.reader = FileSystemReader(str(folder))
        self.reader.set_up_storage_reader(self.md, True)  # the vetted metadata: DCP never unpickles it

    def _check_files(self) -> None:
        missing = sorted({s.relative_path for s in self.md.storage_data.values()
                          if not (self.dir / s.relative_path).is_file()})
        if missing:
            raise ConvertError(f"{self.dir}: data files {missing} named in .metadata are missing; the checkpoint "
                               "is incomplete (copy every writer rank's .distcp file)")

    def tensors(self) -> dict:
        return {k: v for k, v in self.md.state_dict_metadata.items() if hasattr(v, "size")}

    def tensor(self, key: str) -> torch.Tensor:
        return read_region(self.reader, self.md, key)

    def bytes(self, key: str):
        """A pickled non-tensor item, loaded as data only (DCP's own planner would trust it)."""
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import _create_read_items
        planner = _BytesPlanner()
        self.reader.read_data(LoadPlan(_create_read_items(key, self.md.state_dict_metadata[key], None)),
                              planner).wait()
        return unpickle_item(planner.value, self.dir, key)


def unpickle_item(data: bytes, where, key: str):
    """A DCP item pickled by ``torch.save``, as data only, its tensors on the CPU (a GPU run's items may
    hold CUDA tensors: a capturable optimizer's ``lr``; without ``map_location`` this machine would
    need a GPU to read them)."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's message names the global deep in its text
        name, _ = refused_global(exc)
        raise ConvertError(f"{where}: refusing to unpickle {name or 'a class'} in {key}: an optimizer's "
                           "hyperparameters are plain numbers, and unpickling anything else could run code (do not "
                           "trust this checkpoint)") from None


class _BytesPlanner:
    """Receives one pickled item's bytes (``FileSystemReader.read_data`` hands them to ``load_bytes``)."""

    value = b""

    def load_bytes(self, read_item, value):
        self.value = value.read()
