"""Megatron-LM's legacy per-rank checkpoints (``iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt``), read
only: weights at any TP and even PP, unsharded through the family table (``megatron.py`` holds the
torch_dist reader and writer this shares its layout with)."""
from __future__ import annotations

from pathlib import Path

import torch

from toolkit.formats.canonical import Source, TensorInfo
from toolkit.formats.describe import LEGACY_RE
from toolkit.formats.errors import ConvertError
from toolkit.formats.megatron import _McoreNames, storage_key
from toolkit.formats.safeload import safe_load


class LegacySource(Source):
    """Megatron-LM's legacy per-rank files ``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt``, weights
    only: ``model`` is that rank's ``state_dict`` (TP slices, layer numbers local to its pipeline
    stage, an even split). Tensors are unsharded through the family table; the legacy optimizer
    (``distrib_optim.pt``) is not read."""

    def __init__(self, path: Path, hf_config: dict):
        super().__init__(path=path, format="megatron-legacy", hf_config=hf_config)
        ranks = {}
        for d in path.iterdir():
            m = LEGACY_RE.match(d.name)
            if m and (d / "model_optim_rng.pt").is_file():
                ranks[(int(m.group(1)), int(m.group(2) or 0))] = d / "model_optim_rng.pt"
        self.tp = 1 + max(t for t, _ in ranks)
        self.pp = 1 + max(p for _, p in ranks)
        missing = [(t, p) for t in range(self.tp) for p in range(self.pp) if (t, p) not in ranks]
        if missing:
            raise ConvertError(f"{path}: rank files of (tp, pp) {missing} are missing; the checkpoint is incomplete")
        self._states = {k: self._model(f) for k, f in ranks.items()}
        self.step = int(safe_load(ranks[(0, 0)]).get("iteration", 0))
        layers = hf_config.get("num_hidden_layers", hf_config.get("n_layer"))
        if layers % self.pp:
            raise ConvertError(f"{path}: {layers} layers do not split evenly over pp={self.pp}; uneven legacy "
                               "layouts are not supported")
        self._per_stage = layers // self.pp
        emb = self._states[(0, 0)]["embedding.word_embeddings.weight"]
        self.layout_ = _McoreNames(hf_config, emb.shape[0] * self.tp)
        self.layout = {"tp": self.tp, "pp": self.pp}
        for name in self.layout_.hf_names():
            self.infos[name] = TensorInfo(tuple(self._hf_shape(name)), torch.float32)
        self._cache = None

    @staticmethod
    def _model(file: Path) -> dict:
        state = safe_load(file)
        if "model" not in state:
            keys = sorted(k for k in state if k.startswith("model"))
            raise ConvertError(f"{file}: no 'model' entry (found {keys}); interleaved (vpp) legacy checkpoints are "
                               "not supported")
        return {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}

    def _local(self, mcore_name: str) -> tuple[int, list[str]]:
        """Pipeline stage holding ``mcore_name`` and the names it may have in that stage's state dict
        (the local spec's or the TE spec's norm names)."""
        if not mcore_name.startswith("decoder.layers."):
            stage = self.pp - 1 if mcore_name.startswith(("decoder.final_layernorm", "output_layer")) else 0
            return stage, [mcore_name]
        _, _, layer, rest = mcore_name.split(".", 3)
        stage, local = divmod(int(layer), self._per_stage)
        te = storage_key(f"decoder.layers.0.{rest}")[0].removeprefix("decoder.layers.")
        return stage, [f"decoder.layers.{local}.{rest}", f"decoder.layers.{local}.{te}"]

    def _full(self, mcore_name: str) -> torch.Tensor:
        from toolkit.families import unshard
        stage, names = self._local(mcore_name)
        parts = []
        for t in range(self.tp):
            state = self._states[(t, stage)]
            key = next((n for n in names if n in state), None)
            if key is None:
                raise ConvertError(f"{self.path}: rank tp={t} pp={stage} lacks {names[0]}; wrong family or "
                                   "--hf-config?")
            parts.append(state[key])
        return unshard(self.layout_.family, self.layout_.config, mcore_name, parts)

    def _hf_shape(self, name: str):
        m = self.layout_.owner[name]
        stage, names = self._local(m)
        state = self._states[(0, stage)]
        key = next((n for n in names if n in state), None)
        if key is None:
            raise ConvertError(f"{self.path}: no tensor {names[0]} in the pp={stage} files; wrong family or "
                               "--hf-config?")
        meta = [torch.empty(state[key].shape, device="meta") for _ in range(self.tp)]
        from toolkit.families import unshard
        full = unshard(self.layout_.family, self.layout_.config, m, meta)
        return self.layout_.to_hf(m, full)[name].shape

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        if state != "param":
            raise ConvertError(f"{self.path}: legacy Megatron optimizer state is not read (weights only)")
        m = self.layout_.owner[name]
        if self._cache is None or self._cache[0] != m:
            self._cache = (m, self.layout_.to_hf(m, self._full(m)))
        return self._cache[1][name].float().clone()
