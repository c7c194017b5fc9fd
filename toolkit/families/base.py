"""A model family as data: HF config -> megatron-core TransformerConfig, and a weight table.

Two namespaces: ``hf_`` names as in the HF ``state_dict`` and ``mcore_`` names as in a megatron-core
``GPTModel.state_dict()`` with *global* layer numbers. The "full" mcore form is what TP=1 holds:
vocab rows padded to ``padded_vocab``, QKV fused per KV group, GLU as ``[gate; up]``. ``shard``/
``unshard`` turn a full mcore tensor into TP rank ``r``'s tensor and back.

Tensor layouts (``g`` KV groups, ``h`` query heads per group, ``d`` head dim, ``H`` hidden):
  fused QKV weight  ``[g * (h + 2) * d, H]``, per group ``[q heads of the group, k, v]``; TP rank r
                    holds groups ``[r*g/tp, (r+1)*g/tp)``, a contiguous block of rows.
  fused GLU weight  ``[2 * F, H]`` full = ``[gate; up]``; TP rank r holds ``[gate_r; up_r]``.

Mixture-of-experts families add per-expert entries (names with ``{e}``, the *global* expert number;
``mcore`` ``mlp.experts.local_experts.{e}.``, an expert-parallel rank holds a contiguous block of
experts) and say how transformers >= 5 packs the checkpoint's per-expert tensors into one module
parameter (``packed``): HF names in this package are always the *checkpoint* names that
``save_pretrained`` writes, one tensor per expert.

Family files do no I/O and no communication.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from toolkit.families.torchtitan import TorchtitanNames

REPLICATED, COLUMN, ROW, VOCAB = "replicated", "column", "row", "vocab"
"""TP split of a full mcore tensor: none, dim 0, dim 1, dim 0 of the padded vocabulary."""

ACTIVATIONS: dict[str, Callable] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE variants whose frequencies are fixed at init and need no attention scaling: the adapter
copies HF's own ``inv_freq`` into megatron's rotary embedding, so all of them are exact."""


MCORE_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")
"""megatron's TransformerConfig fields that fix tensor shapes (``Family.missing_fields``)."""


class FamilyError(ValueError):
    """An HF model or checkpoint this family cannot convert; the message says why and what to do."""


@dataclass
class Dims:
    """What the weight table needs from an HF config (and the layout)."""
    heads: int
    groups: int
    head_dim: int
    hidden: int
    vocab: int
    padded_vocab: int


# --- weight table entries ------------------------------------------------------------------------

@dataclass(frozen=True)
class Rename:
    """One HF tensor is one mcore tensor. ``transpose``: HF stores it as a Conv1D ``[in, out]``."""
    hf: str
    mcore: str
    split: str = REPLICATED
    transpose: bool = False

    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def to_mcore(self, t: dict[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        x = t[self.hf].t() if self.transpose else t[self.hf]
        return _pad_vocab(x, dims.padded_vocab) if self.split == VOCAB else x

    def to_hf(self, x: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        if self.split == VOCAB:
            x = x[:dims.vocab]
        return {self.hf: x.t() if self.transpose else x}

    def shard(self, x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        return _split(x, self.split, tp, rank)

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return _join(parts, self.split)

    def read_shard(self, reader: "Reader", dims: Dims, tp: int, rank: int) -> torch.Tensor:
        """TP rank ``rank``'s tensor, reading only its slice of the HF tensor."""
        if self.split == VOCAB:
            per = dims.padded_vocab // tp
            lo, hi = rank * per, min((rank + 1) * per, dims.vocab)
            rows = reader.slice(self.hf, 0, lo, hi) if lo < hi else None
            width = reader.shape(self.hf)[1]
            pad = torch.zeros(per - max(hi - lo, 0), width, dtype=reader.dtype(self.hf))
            return pad if rows is None else torch.cat([rows, pad]) if len(pad) else rows
        if self.split == REPLICATED or tp == 1:
            x = reader.slice(self.hf)
        else:
            mdim = 1 if self.split == ROW else 0
            hdim = 1 - mdim if self.transpose else mdim
            x = reader.slice(self.hf, hdim, *_range(reader.shape(self.hf)[hdim], tp, rank))
        return x.t().contiguous() if self.transpose else x


@dataclass(frozen=True)
class FuseQKV:
    """HF q, k, v (``[heads * d, H]`` weights or ``[heads * d]`` biases) -> megatron's grouped QKV.

    ``hf`` is three names, or one name of a packed ``[q; k; v]`` tensor (GPT-2's ``c_attn``,
    a Conv1D: ``transpose``)."""
    hf: tuple[str, ...]
    mcore: str
    transpose: bool = False
    split: str = COLUMN

    def hf_names(self) -> tuple[str, ...]:
        return self.hf

    def to_mcore(self, t: dict[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        q, k, v = self._qkv(t, dims)
        return _fuse_groups(q, k, v, dims.groups, dims.head_dim)

    def read_shard(self, reader: "Reader", dims: Dims, tp: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s KV groups only: q rows of its groups, then k and v rows of them."""
        g, d = dims.groups, dims.head_dim
        qd = dims.heads // g * d
        g_lo, g_hi = _range(g, tp, rank)
        if len(self.hf) == 3:
            q = reader.slice(self.hf[0], 0, g_lo * qd, g_hi * qd)
            k = reader.slice(self.hf[1], 0, g_lo * d, g_hi * d)
            v = reader.slice(self.hf[2], 0, g_lo * d, g_hi * d)
        else:  # packed [q; k; v] rows (columns of a Conv1D)
            dim, base_k, base_v = (1 if self.transpose else 0), dims.heads * d, dims.heads * d + g * d
            parts = [reader.slice(self.hf[0], dim, a, b) for a, b in
                     ((g_lo * qd, g_hi * qd), (base_k + g_lo * d, base_k + g_hi * d),
                      (base_v + g_lo * d, base_v + g_hi * d))]
            q, k, v = (p.t() for p in parts) if self.transpose else parts
        return _fuse_groups(q, k, v, g_hi - g_lo, d)

    def _qkv(self, t, dims):
        if len(self.hf) == 3:
            return [t[n] for n in self.hf]
        packed = t[self.hf[0]].t() if self.transpose else t[self.hf[0]]
        q_rows, kv_rows = dims.heads * dims.head_dim, dims.groups * dims.head_dim
        return torch.split(packed, [q_rows, kv_rows, kv_rows], dim=0)

    def to_hf(self, x: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        g, d = dims.groups, dims.head_dim
        qd = dims.heads // g * d
        rest = x.shape[1:]
        grouped = x.reshape(g, qd + 2 * d, *rest)
        q, k, v = (p.reshape(-1, *rest) for p in torch.split(grouped, [qd, d, d], dim=1))
        if len(self.hf) == 3:
            return dict(zip(self.hf, (q.contiguous(), k.contiguous(), v.contiguous())))
        packed = torch.cat([q, k, v], dim=0)
        return {self.hf[0]: packed.t().contiguous() if self.transpose else packed}

    def shard(self, x, tp, rank):
        return _split(x, COLUMN, tp, rank)  # whole KV groups per rank: rows are grouped

    def unshard(self, parts):
        return _join(parts, COLUMN)


@dataclass(frozen=True)
class FuseGLU:
    """HF gate and up projections ``[F, H]`` -> megatron's ``linear_fc1`` (``[gate_r; up_r]`` per rank).

    ``hf`` is two names, or one name of a packed ``[gate; up]`` tensor (Phi-3's ``gate_up_proj``)."""
    hf: tuple[str, ...]
    mcore: str
    split: str = COLUMN

    def hf_names(self) -> tuple[str, ...]:
        return self.hf

    def to_mcore(self, t, dims):
        return torch.cat([t[n] for n in self.hf], dim=0)

    def to_hf(self, x, dims):
        if len(self.hf) == 1:
            return {self.hf[0]: x.contiguous()}
        gate, up = torch.chunk(x, 2, dim=0)
        return {self.hf[0]: gate.contiguous(), self.hf[1]: up.contiguous()}

    def shard(self, x, tp, rank):
        gate, up = torch.chunk(x, 2, dim=0)
        return torch.cat([_split(gate, COLUMN, tp, rank), _split(up, COLUMN, tp, rank)], dim=0)

    def read_shard(self, reader: "Reader", dims: Dims, tp: int, rank: int) -> torch.Tensor:
        if len(self.hf) == 1:  # packed: the gate's rows of this rank, then the up projection's
            width = reader.shape(self.hf[0])[0] // 2
            lo, hi = _range(width, tp, rank)
            return torch.cat([reader.slice(self.hf[0], 0, lo, hi), reader.slice(self.hf[0], 0, width + lo, width + hi)])
        rows = _range(reader.shape(self.hf[0])[0], tp, rank)
        return torch.cat([reader.slice(self.hf[0], 0, *rows), reader.slice(self.hf[1], 0, *rows)])

    def unshard(self, parts):
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)


Entry = Rename | FuseQKV | FuseGLU


def expert_entry(entry: Entry, e: int) -> Entry:
    """``entry`` with ``{e}`` in its names replaced by the expert number."""
    hf = tuple(n.format(e=e) for n in entry.hf) if isinstance(entry.hf, tuple) else entry.hf.format(e=e)
    return dataclasses.replace(entry, hf=hf, mcore=entry.mcore.format(e=e))


@dataclass(frozen=True)
class Packed:
    """One parameter of the transformers (>= 5) module holding checkpoint tensors.

    ``per_expert``: ``module`` is ``[E, *rows]`` whose slice e is the concatenation (dim 0) of
    ``parts`` with ``{e}`` = e, e.g. ``gate_up_proj [E, 2F, H] = stack_e(cat(w1_e, w3_e))``;
    otherwise ``module`` is the concatenation of ``parts`` (one part: a rename). Either way each
    checkpoint tensor is one contiguous range of the module tensor's elements, so a reader serves
    it without materializing the packed tensor."""
    module: str
    parts: tuple[str, ...]
    per_expert: bool = False


class Reader:
    """Read access to HF tensors by name: whole, or a ``[start, stop)`` range along one dim.
    ``MappingReader`` serves a state dict; the megatron adapter serves safetensors slices."""

    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def slice(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor: ...


class MappingReader(Reader):
    def __init__(self, tensors: Mapping[str, torch.Tensor], prefix: str = ""):
        self.tensors, self.prefix = tensors, prefix

    def shape(self, name):
        return tuple(self.tensors[self.prefix + name].shape)

    def dtype(self, name):
        return self.tensors[self.prefix + name].dtype

    def slice(self, name, dim=None, start=0, stop=None):
        t = self.tensors[self.prefix + name]
        return t if dim is None else t.narrow(dim, start, stop - start)


def _range(size: int, tp: int, rank: int) -> tuple[int, int]:
    if size % tp:
        raise FamilyError(f"cannot split a dimension of {size} into tp={tp} equal parts")
    per = size // tp
    return rank * per, (rank + 1) * per


def _fuse_groups(q, k, v, groups: int, d: int) -> torch.Tensor:
    """``[groups * (h + 2) * d, ...]``: per group its q heads, then k, then v."""
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k, v = k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _pad_vocab(x: torch.Tensor, padded: int) -> torch.Tensor:
    """Zero rows up to the padded vocabulary (their logits are masked out of the loss)."""
    if x.shape[0] > padded:
        raise FamilyError(f"vocabulary tensor has {x.shape[0]} rows, more than padded_vocab={padded}")
    return torch.cat([x, x.new_zeros(padded - x.shape[0], *x.shape[1:])]) if padded > x.shape[0] else x


def _split(x: torch.Tensor, split: str, tp: int, rank: int) -> torch.Tensor:
    if split == REPLICATED or tp == 1:
        return x
    dim = 1 if split == ROW else 0
    if x.shape[dim] % tp:
        raise FamilyError(f"cannot split a tensor of shape {tuple(x.shape)} into tp={tp} parts on dim {dim}")
    return torch.chunk(x, tp, dim=dim)[rank].contiguous()


def _join(parts: list[torch.Tensor], split: str) -> torch.Tensor:
    if split == REPLICATED or len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=1 if split == ROW else 0)


# --- the family ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """An HF config field the family cannot honour: ``bad(value)`` (or ``bad(value, hf_config)``
    with ``needs_config``) true -> error with ``fix``."""
    field: str
    bad: Callable[..., bool]
    fix: str
    needs_config: bool = False


QK_NORMS = (None, "head", "full")
"""Where a family normalizes queries and keys (``LayerSpec.qk_norm``)."""


@dataclass(frozen=True)
class LayerSpec:
    """A family's choices of transformer-layer submodules (what its megatron layer spec holds); the
    megatron adapter turns them into megatron-core's ``TransformerLayerSubmodules``. The weight table
    names the tensors of each choice (the mcore names below)."""
    pre_norms: bool = True
    """A norm before the attention and before the MLP (``input_layernorm``, ``pre_mlp_layernorm``);
    False: megatron's ``IdentityOp`` in both places (OLMo 2 normalizes only sublayer outputs)."""
    post_norms: bool = False
    """A norm on the attention's and on the MLP's output, before each residual add (Gemma 2, OLMo 2:
    HF's ``post_attention_layernorm`` / ``post_feedforward_layernorm``); mcore names
    ``self_attention.linear_proj.post_norm.weight`` and ``mlp.linear_fc2.post_norm.weight``."""
    qk_norm: str | None = None
    """RMSNorm of queries and keys before RoPE: ``"head"`` over each head's ``head_dim`` (Qwen3,
    megatron's ``qk_layernorm``); ``"full"`` over all heads' width at once (OLMo 2: ``[heads * d]``
    and ``[groups * d]`` weights, split over TP with the heads); mcore names
    ``self_attention.{q,k}_layernorm.weight``."""

    def __post_init__(self):
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"LayerSpec.qk_norm={self.qk_norm!r}; choose one of {QK_NORMS}")


@dataclass(frozen=True)
class Family:
    model_type: str
    config: Mapping[str, str]
    """HF config field -> TransformerConfig field (value copied)."""
    fixed: Mapping[str, object]
    """TransformerConfig fields with a fixed value for the family."""
    top: tuple[Entry, ...]
    layer: tuple[Entry, ...]
    """Names relative to ``hf_layer`` / ``decoder.layers.{i}.``."""
    derived: Mapping[str, Callable] = field(default_factory=dict)
    """TransformerConfig field -> function of the HF config, for what a plain copy cannot say."""
    hf_layer: str = "model.layers.{i}."
    position_embedding: str = "rope"
    activation_field: str = "hidden_act"
    checks: tuple[Check, ...] = ()
    tied_field: str = "tie_word_embeddings"
    padding_idx_field: str | None = None
    """HF config field naming the embedding's ``padding_idx`` (its row gets no gradient from the
    lookup, as in ``nn.Embedding(padding_idx=...)``); None when the HF model has none."""
    experts: tuple[Entry, ...] = ()
    """Mixture of experts: entries repeated for every routed expert (names with ``{e}``)."""
    num_experts_field: str | None = None
    """HF config field holding the number of routed experts (MoE families only)."""
    packed: tuple[Packed, ...] = ()
    """Per layer (names relative to ``hf_layer``): transformers' module parameters that pack
    checkpoint tensors (MoE experts); the rest are stored under their checkpoint names."""
    windows: Callable | None = None
    """HF config -> sliding window of each layer (keys at distance < window; None: full attention);
    served by the toolkit's core attention, refused with megatron's local one."""
    attention_softcap: Callable | None = None
    """HF config -> attention logit softcapping (``cap * tanh(score / cap)``, Gemma 2); None: none."""
    logit_softcap: Callable | None = None
    """HF config -> final logit softcapping of the LM head's output (Gemma 2); None: none."""
    layer_spec: LayerSpec = LayerSpec()
    """The layer's structure where it is not Llama's pre-norm layer: the megatron adapter builds its
    layer spec from these choices, so a structural family needs no edit outside its file."""
    embedding_scale: Callable | None = None
    """HF config -> the factor the embedding lookup is multiplied by (Gemma: sqrt(hidden)); None: 1."""
    torchtitan: TorchtitanNames | None = None
    """torchtitan's names of this family's model (None: torchtitan has no such model; ``extend``
    does not inherit them)."""

    def num_experts(self, hf_config) -> int:
        """Routed experts per MoE layer; 0 for a dense family."""
        return int(getattr(hf_config, self.num_experts_field)) if self.num_experts_field else 0

    def sliding_windows(self, hf_config) -> tuple[int | None, ...]:
        """Each layer's sliding window, or () where every layer attends to all earlier tokens."""
        windows = tuple(self.windows(hf_config)) if self.windows else ()
        return windows if any(w is not None for w in windows) else ()

    def padding_idx(self, hf_config) -> int | None:
        return getattr(hf_config, self.padding_idx_field, None) if self.padding_idx_field else None

    def extend(self, drop: tuple[str, ...] = (), **changes) -> "Family":
        """A derived family; ``layer``/``top`` replace entries with the same mcore name, or append;
        ``drop`` removes entries by mcore name (a MoE family drops the dense MLP)."""
        for key in ("layer", "top"):
            if key in changes or drop:
                new = {e.mcore: e for e in changes.get(key, ())}
                kept = [new.pop(e.mcore, e) for e in getattr(self, key) if e.mcore not in drop]
                changes[key] = tuple(kept) + tuple(new.values())
        for key in ("config", "fixed", "derived"):
            if key in changes:
                changes[key] = {**getattr(self, key), **changes[key]}
        if "checks" in changes:
            changes["checks"] = self.checks + tuple(changes["checks"])
        changes.setdefault("torchtitan", None)  # torchtitan's names are its own models', never inherited
        return dataclasses.replace(self, **changes)

    # --- config -----------------------------------------------------------------------------------

    def missing_fields(self, config_json: dict) -> list[str]:
        """The fields that fix tensor shapes (layers, widths, heads, vocabulary) that ``config.json``
        leaves out. transformers would fill them with its class defaults (a 4096-wide, 32-layer
        Llama), which no conversion or megatron build may assume of a checkpoint."""
        needed = [hf for hf, mcore in self.config.items() if mcore in MCORE_SHAPE_FIELDS] + ["vocab_size"]
        return [f for f in needed if config_json.get(f) is None]

    def check(self, hf_config) -> None:
        """Raise FamilyError naming every HF config field this family cannot honour."""
        problems = []
        for c in self.checks:
            value = getattr(hf_config, c.field, None)
            if c.bad(value, hf_config) if c.needs_config else c.bad(value):
                problems.append(f"{c.field}={value!r} is not supported by the megatron path; {c.fix}")
        act = getattr(hf_config, self.activation_field, None)
        if act not in ACTIVATIONS:
            problems.append(f"{self.activation_field}={act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        if self.position_embedding == "rope":
            rope_type = rope_parameters(hf_config).get("rope_type", "default")
            if rope_type not in ROPE_TYPES:
                problems.append(f"rope scaling type {rope_type!r} is not supported (it changes frequencies at "
                                f"run time or scales attention); supported: {list(ROPE_TYPES)}")
        if problems:
            raise FamilyError(f"{self.model_type} config cannot be converted exactly:\n  " + "\n  ".join(problems))

    def transformer_config(self, hf_config) -> dict:
        """TransformerConfig keyword arguments for this HF config (no layout fields)."""
        self.check(hf_config)
        out = {mcore: getattr(hf_config, hf) for hf, mcore in self.config.items()}
        out.update(self.fixed)
        out.update(qk_layernorm=self.layer_spec.qk_norm == "head")  # megatron's own, per head
        out.update({k: fn(hf_config) for k, fn in self.derived.items()})
        d = self.dims(hf_config, 1)
        out.update(num_query_groups=d.groups, kv_channels=d.head_dim,
                   activation_func=ACTIVATIONS[getattr(hf_config, self.activation_field)])
        return out

    def model_kwargs(self, hf_config) -> dict:
        """GPTModel keyword arguments besides config, spec and vocab size."""
        return {"max_sequence_length": hf_config.max_position_embeddings,
                "position_embedding_type": self.position_embedding,
                "share_embeddings_and_output_weights": self.tied(hf_config)}

    def tied(self, hf_config) -> bool:
        return bool(getattr(hf_config, self.tied_field, False))

    def dims(self, hf_config, padded_vocab: int) -> Dims:
        heads, groups, head_dim = attention_dims(hf_config)
        return Dims(heads, groups, head_dim, hf_config.hidden_size, hf_config.vocab_size,
                    max(padded_vocab, hf_config.vocab_size))

    # --- weight table -----------------------------------------------------------------------------

    def entries(self, hf_config, layers) -> list[tuple[Entry, str, str]]:
        """(entry, hf prefix, mcore prefix) for the top tensors and the given global layers."""
        out = [(e, "", "") for e in self.top if not (self.tied(hf_config) and e.mcore == "output_layer.weight")]
        per_layer = list(self.layer) + [expert_entry(x, e) for e in range(self.num_experts(hf_config))
                                        for x in self.experts]
        for i in layers:
            out += [(e, self.hf_layer.format(i=i), f"decoder.layers.{i}.") for e in per_layer]
        return out


def attention_dims(hf_config) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head dim) of an HF config: the one derivation the weight
    table, the run plan (estimate, FLOPs) and the engines use. ``head_dim`` is the config's when it
    has one (it need not be hidden / heads)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim


def rope_parameters(hf_config) -> dict:
    """HF's RoPE settings (transformers 5 ``rope_parameters``; older ``rope_scaling``/``rope_theta``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


