"""Megatron-core adapter: layout checks, this rank's GPTModel stage(s) from an HF model, an Engine.

Only this module (and convert/) imports megatron. Order of what ``MegatronEngine`` applies:
  1. process groups (``initialize_model_parallel``: tp, pp, vpp; dp = world / (tp * pp))
  2. model chunks: ``GPTModel`` with the local layer spec, this stage's layers only
  3. weights: the HF model's tensors through the family table, each rank copying only its TP slice
  4. DDP (grads reduced in fp32 buckets) + distributed optimizer (Adam, decoupled weight decay)
  5. steps with ``get_forward_backward_func`` (no pipelining, 1F1B, or interleaved 1F1B)

Loss contract (same as the DeepSpeed path): the gradient is that of ``sum(token losses of the global
batch) / loss_tokens``. Megatron is run with ``calculate_per_token_loss=True`` so neither the
schedule (which would divide by the number of micro-batches) nor DDP (which would divide by dp)
rescales; after the DP all-reduce has summed the per-rank sums, the grads are scaled by
``1 / loss_tokens`` once. Padded vocabulary columns get -inf logits before the vocab-parallel
cross entropy, so they never reach the loss.
"""
from __future__ import annotations

import json
import time
from functools import lru_cache, partial
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from toolkit.config import ConfigError, RunConfig
from toolkit.engine import IGNORE_INDEX, StepStats
from toolkit.families.base import Reader

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


PRESET_DIR = Path(__file__).resolve().parents[2] / "megatron_configs"
PRESET_KEYS = ("tp", "pp", "vpp", "ep", "first_stage_layers", "last_stage_layers", "sequence_parallel",
               "make_vocab_size_divisible_by", "recompute", "moe_dispatcher")


# --- presets and layout checks (no megatron import: run in the launcher before any rank starts) -----

def apply_preset(cfg: RunConfig) -> None:
    """Fill megatron.* fields from ``megatron.preset`` (a megatron_configs/ name or a YAML path);
    fields set explicitly in the run config win."""
    import yaml
    name = cfg.megatron.preset
    if not name:
        return
    path = Path(name) if Path(name).is_file() else PRESET_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ConfigError(f"megatron.preset={name!r} is neither a file nor one of megatron_configs/ {known}")
    preset = yaml.safe_load(path.read_text()) or {}
    bad = sorted(set(preset) - set(PRESET_KEYS))
    if bad:
        raise ConfigError(f"{path}: keys {bad} are not layout fields; a preset may set only {list(PRESET_KEYS)}")
    for key, value in preset.items():
        if key not in cfg.megatron.model_fields_set:
            try:
                setattr(cfg.megatron, key, value)
            except ValueError as exc:
                raise ConfigError(f"{path}: {key}={value!r}: {exc}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(cfg: RunConfig, hf_config, world_size: int) -> dict:
    """Every megatron layout constraint, with the numbers and the valid choices; returns the layout."""
    from toolkit.families import FamilyError, get_family
    m = cfg.megatron
    try:
        family = get_family(hf_config.model_type)
        family.check(hf_config)
    except FamilyError as exc:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: {exc}") from None
    dims = family.dims(hf_config, 1)
    layers = hf_config.num_hidden_layers
    if world_size % (m.tp * m.pp):
        raise ConfigError(f"world size {world_size} is not divisible by megatron.tp={m.tp} x megatron.pp={m.pp}; "
                          f"choose tp x pp in {_divisors(world_size)} or nproc a multiple of {m.tp * m.pp}")
    for name, value in (("num_attention_heads", dims.heads), ("num_key_value_heads", dims.groups)):
        if value % m.tp:
            valid = [t for t in _divisors(dims.groups) if dims.heads % t == 0]
            raise ConfigError(f"{name}={value} is not divisible by megatron.tp={m.tp}; choose tp in {valid}")
    if m.first_stage_layers is not None or m.last_stage_layers is not None:
        _check_uneven_split(m, layers)
    elif layers % (m.pp * (m.vpp or 1)):
        chunks = m.pp * (m.vpp or 1)
        valid = [p for p in _divisors(layers) if world_size % (p * m.tp) == 0 and layers % (p * (m.vpp or 1)) == 0]
        raise ConfigError(f"num_hidden_layers={layers} is not divisible by megatron.pp={m.pp} x megatron.vpp="
                          f"{m.vpp or 1} (= {chunks} model chunks); choose pp in {valid}"
                          + (" or a vpp that divides layers / pp" if m.vpp else
                             ", or split unevenly with megatron.first_stage_layers / last_stage_layers"))
    if m.vpp and m.pp < 2:
        raise ConfigError(f"megatron.vpp={m.vpp} needs megatron.pp >= 2 (got pp={m.pp}); unset vpp or raise pp")
    dp = world_size // (m.tp * m.pp)
    n_micro = cfg.train.global_batch_size // max(cfg.train.micro_batch_size * dp, 1)
    if m.vpp and n_micro % m.pp:
        raise ConfigError(f"interleaved pipeline (megatron.vpp={m.vpp}) needs micro-batches per step ({n_micro} = "
                          f"global_batch_size / (micro_batch_size x dp={dp})) divisible by pp={m.pp}")
    if m.sequence_parallel:
        _check_sequence_parallel(m, cfg.data.seq_len)
    _check_experts(m, family.num_experts(hf_config), world_size, hf_config.model_type)
    from toolkit.families import padded_vocab_size
    return {"tp": m.tp, "pp": m.pp, "vpp": m.vpp, "ep": m.ep, "dp": dp, "sequence_parallel": m.sequence_parallel,
            "padded_vocab": padded_vocab_size(hf_config.vocab_size, m.make_vocab_size_divisible_by, m.tp)}


def _check_experts(m, experts: int, world_size: int, model_type: str) -> None:
    """Expert parallelism: ep divides the experts and, with tp and pp, the world (megatron carves
    the ep ranks out of each DP group; expert tensor parallelism equals tp)."""
    if not experts:
        if m.ep > 1:
            raise ConfigError(f"megatron.ep={m.ep} needs a mixture-of-experts model; {model_type} has no experts "
                              "(unset megatron.ep)")
        return
    if experts % m.ep:
        raise ConfigError(f"{experts} experts do not divide over megatron.ep={m.ep}; choose ep in {_divisors(experts)}")
    if world_size % (m.tp * m.ep * m.pp):
        raise ConfigError(f"world size {world_size} is not divisible by megatron.tp={m.tp} x ep={m.ep} x pp={m.pp}; "
                          f"use nproc a multiple of {m.tp * m.ep * m.pp} or a smaller ep")
    if m.tp > 1 and not m.sequence_parallel:
        raise ConfigError(f"megatron.tp={m.tp} with a mixture-of-experts model needs megatron.sequence_parallel=true "
                          "(megatron-core's MoE layer requires it under tensor parallelism)")
    if m.moe_dispatcher == "alltoall" and not torch.cuda.is_available():
        raise ConfigError("megatron.moe_dispatcher=alltoall needs GPUs (its all_to_all fails on CPU/gloo); "
                          "use megatron.moe_dispatcher=allgather")


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


# --- HF weights ---------------------------------------------------------------------------------------

class SafetensorsReader(Reader, Mapping):
    """An HF checkpoint directory read on demand: whole tensors by name (a Mapping), or just a
    range along one dim (a ``families.Reader``) through safetensors slices, so a TP rank reads only
    its own part of each tensor."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"model.init=pretrained: no *.safetensors in {model_dir}; the megatron path reads "
                              "safetensors (convert with save_pretrained(safe_serialization=True))")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __getitem__(self, key):
        return self._where[key].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def shape(self, name):
        return tuple(self._where[name].get_slice(name).get_shape())

    def dtype(self, name):
        return self._where[name].get_slice(name)[0:0].dtype

    def slice(self, name, dim=None, start=0, stop=None):
        part = self._where[name].get_slice(name)
        if dim is None:
            return part[:]
        return part[start:stop] if dim == 0 else part[:, start:stop]


def hf_weights(cfg: RunConfig) -> Mapping[str, torch.Tensor]:
    """HF tensors by checkpoint name: the checkpoint (lazily) or the seeded random init of ``build_model``."""
    from toolkit.families import get_family
    if cfg.model.init == "pretrained":
        path = Path(cfg.model.name_or_path)
        return SafetensorsReader(path.parent if path.is_file() else path)
    from toolkit.adapters.hf import build_model
    model = build_model(cfg)
    return checkpoint_names(get_family(model.config.model_type), model.config, model.state_dict())


def checkpoint_names(family, hf_config, state):
    """HF tensors under their checkpoint names (MoE experts one tensor each, as ``save_pretrained``
    writes them), from a transformers module state; a lazy reader is passed through."""
    from toolkit.families import unpack
    return state if isinstance(state, Reader) else unpack(family, hf_config, state)


# --- model --------------------------------------------------------------------------------------------

def transformer_config(cfg: RunConfig, hf_config, family):
    from megatron.core.transformer import TransformerConfig
    m, dtype = cfg.megatron, DTYPES[cfg.model.dtype]
    kw = family.transformer_config(hf_config)
    kw.update(tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp,
              virtual_pipeline_model_parallel_size=m.vpp, sequence_parallel=m.sequence_parallel,
              num_layers_in_first_pipeline_stage=m.first_stage_layers,
              num_layers_in_last_pipeline_stage=m.last_stage_layers,
              params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
              calculate_per_token_loss=True, bias_activation_fusion=False, masked_softmax_fusion=False,
              bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
              gradient_accumulation_fusion=False, **_recompute(m.recompute))
    if m.vpp:
        # Megatron-LM's interleaved default. With batched p2p, at pp = 2 (the previous and the next
        # stage are one peer) the steady state sends an activation and a gradient to that peer in
        # one batch on one group while the peer posts its receives in the other order: on gloo the
        # two swap (same shapes, wrong gradients). The overlapped path uses a group per direction.
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if family.num_experts(hf_config):
        # The load-balancing loss is the toolkit's (LoadBalancedRouter), not megatron's.
        kw.update(expert_model_parallel_size=m.ep, moe_token_dispatcher_type=m.moe_dispatcher,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                  moe_permute_fusion=False, moe_router_fusion=False)
    if not torch.cuda.is_available():
        from toolkit.compat import megatron_cpu
        kw.update(megatron_cpu.TRANSFORMER_CONFIG)
    return TransformerConfig(**kw)


def _recompute(mode: str) -> dict:
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def build_chunks(cfg: RunConfig, hf_config, family, tconfig, padded_vocab: int) -> list:
    """This rank's GPTModel chunk(s): one per virtual pipeline stage, holding only its layers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    vpp = cfg.megatron.vpp
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        chunks.append(GPTModel(tconfig, layer_spec(tconfig, vp), vocab_size=padded_vocab, vp_stage=vp,
                               pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                               post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                               **family.model_kwargs(hf_config)))
    return chunks


def layer_spec(tconfig, vp_stage: int | None):
    """megatron's local layer spec (torch norms; MoE: sequential experts and ``LoadBalancedRouter``);
    with sequence parallelism, a block spec whose norms are ``SequenceParallelNorm`` (megatron's own
    torch-norm wrapper refuses sequence parallelism)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(num_experts=tconfig.num_moe_experts, moe_grouped_gemm=False,
                                    normalization=tconfig.normalization)
    if tconfig.num_moe_experts:
        spec.submodules.mlp.submodules.router = load_balanced_router_class()
    if not tconfig.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tconfig, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelNorm)


class SequenceParallelNorm:
    """A torch ``LayerNorm`` / ``RMSNorm`` (what megatron's ``WrappedTorchNorm`` builds) whose
    parameters are marked ``sequence_parallel``. Under sequence parallelism each TP rank normalizes
    its own ``[seq / tp, batch, hidden]`` slice, so each holds a partial gradient of the (replicated)
    norm weights; megatron's ``finalize_model_grads`` sums the gradients of marked parameters over
    the TP group, as it does for Transformer Engine's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization={config.normalization!r}: sequence parallelism supports {sorted(norms)}")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


@lru_cache(maxsize=1)
def load_balanced_router_class():
    """megatron's ``TopKRouter`` that adds the toolkit's load-balancing loss (``toolkit/moe.py``, the
    same definition as the DeepSpeed path) to its routing, and records tokens per expert.

    Per training forward of a micro-batch and layer: ``aux`` from this rank's logits and the tokens
    per expert of the whole sequence (summed over the TP group under sequence parallelism, where
    each rank routes a slice), attached to the routing probabilities with weight ``aux_scale``,
    which the engine sets each step. Not in eval, and once per micro-batch under recomputation
    (the recomputing forward is the one with gradients)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router import TopKRouter

    from toolkit import moe

    class LoadBalancedRouter(TopKRouter):
        aux_scale: float = 0.0
        stats: "moe.RouterStats | None" = None

        def routing(self, logits, padding_mask=None):
            probs, routing_map = super().routing(logits, padding_mask)
            if not (self.training and torch.is_grad_enabled()):
                return probs, routing_map
            flat = logits.reshape(-1, self.config.num_moe_experts)
            counts = routing_map.sum(dim=0)
            tokens = flat.shape[0]
            if self.config.sequence_parallel:
                dist.all_reduce(counts, group=ps.get_tensor_model_parallel_group())
                tokens *= ps.get_tensor_model_parallel_world_size()
            aux = moe.load_balancing_loss(flat, counts, tokens)
            if self.stats is not None:  # TP ranks hold the same counts and partial aux sums
                self.stats.add(self.layer_number - 1, counts if ps.get_tensor_model_parallel_rank() == 0 else None,
                               aux.detach())
            if self.aux_scale:
                probs = moe.AttachLoss.apply(probs, aux * self.aux_scale)
            return probs, routing_map

    return LoadBalancedRouter


def _global_name(name: str, offset: int, expert_offset: int = 0) -> str:
    """A chunk's parameter name with global layer (and expert) numbers."""
    from toolkit.families import EXPERTS, split_expert
    if not name.startswith("decoder.layers."):
        return name
    expert = split_expert(name)
    if expert is not None:
        layer, e, tail = expert
        return f"decoder.layers.{layer + offset}.{EXPERTS}{e + expert_offset}.{tail}"
    _, _, i, rest = name.split(".", 3)
    return f"decoder.layers.{int(i) + offset}.{rest}"


def expert_offset(chunk) -> int:
    """Global number of this rank's first routed expert (expert parallel ranks hold blocks)."""
    if not getattr(chunk.config, "num_moe_experts", None):
        return 0
    from megatron.core import parallel_state as ps
    per_rank = chunk.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank() * per_rank


def is_expert(name: str) -> bool:
    from toolkit.families import split_expert
    return split_expert(name) is not None


def _local_params(chunk) -> dict[str, torch.Tensor]:
    return {n: t for n, t in chunk.state_dict(keep_vars=True).items() if not n.endswith("_extra_state")}


def layer_offset(chunk) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    return get_transformer_layer_offset(chunk.config, vp_stage=getattr(chunk, "vp_stage", None))


def load_hf_into_chunk(chunk, family, hf_config, hf_state, padded_vocab: int, tp: int, tp_rank: int) -> None:
    """Copy this rank's slices of the HF tensors into ``chunk``; every parameter exactly once,
    reading only those slices (``hf_state``: a state dict, or a ``SafetensorsReader``)."""
    from toolkit.families import MappingReader, Reader, read_shard, table
    offset, tied = layer_offset(chunk), family.tied(hf_config)
    local = _local_params(chunk)
    source = {n: _global_name(n, offset, expert_offset(chunk)) for n in local}
    if tied:  # a last pipeline stage holds its own copy of the tied embedding as output_layer
        source = {n: "embedding.word_embeddings.weight" if g == "output_layer.weight" else g for n, g in source.items()}
    known = table(family, hf_config)
    unknown = sorted(g for g in source.values() if g not in known)
    if unknown:
        raise RuntimeError(f"{family.model_type}: megatron parameters missing from the weight table: {unknown}")
    reader = hf_state if isinstance(hf_state, Reader) else MappingReader(hf_state)
    with torch.no_grad():
        for name, param in local.items():  # one slice at a time: memory bounded by the largest
            part = read_shard(family, hf_config, source[name], reader, padded_vocab, tp, tp_rank)
            if part.shape != param.shape:
                raise RuntimeError(f"{name}: converted slice has shape {tuple(part.shape)}, the model "
                                   f"expects {tuple(param.shape)}")
            param.copy_(part)
    _copy_rope(chunk, family, hf_config)
    _padding_idx_without_grad(chunk, family.padding_idx(hf_config))


def _padding_idx_without_grad(chunk, pad: int | None) -> None:
    """HF's ``nn.Embedding(padding_idx=pad)``: the lookup of ``pad`` sends no gradient to its row
    (the output layer still does when embeddings are tied). Megatron's embedding has no such
    option, so the looked-up vectors at ``pad`` positions are detached."""
    emb = getattr(getattr(chunk, "embedding", None), "word_embeddings", None)
    if pad is None or emb is None:
        return

    def hook(module, args, output):
        at_pad = args[0] == pad  # [batch, seq]
        if output.shape[:2] != at_pad.shape:  # sequence parallel: [seq / tp, batch, h], this TP rank's slice
            from megatron.core import parallel_state as ps
            local = output.shape[0]
            start = ps.get_tensor_model_parallel_rank() * local
            at_pad = at_pad.t()[start:start + local]
        return torch.where(at_pad.unsqueeze(-1), output.detach(), output)

    emb.register_forward_hook(hook)


def _copy_rope(chunk, family, hf_config) -> None:
    """Use HF's own RoPE frequencies (default, linear and llama3 scaling alike): exact by construction."""
    rope = getattr(chunk, "rotary_pos_emb", None)
    if rope is None or family.position_embedding != "rope":
        return
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolkit.families import rope_parameters
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type == "default":
        params = rope_parameters(hf_config)
        dim = rope.inv_freq.numel() * 2
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        assert scaling == 1.0, f"rope type {rope_type} scales attention by {scaling}"
    rope.inv_freq = inv_freq.to(rope.inv_freq.device, rope.inv_freq.dtype)


def check_hf_keys(family, hf_config, hf_state) -> None:
    """Strictness on the whole HF checkpoint without reading tensors: every key is in the table."""
    from toolkit.families import table
    from toolkit.families.base import FamilyError
    used = {hp + n for e, hp in table(family, hf_config).values() for n in e.hf_names()}
    keys = set(hf_state.keys())
    missing, unexpected = sorted(used - keys), sorted(keys - used - ({"lm_head.weight"} if family.tied(hf_config) else set()))
    if missing or unexpected:
        raise FamilyError(f"{family.model_type}: HF weights do not match the table; missing {missing[:20]}, "
                          f"unexpected { {k: tuple(hf_state[k].shape) for k in unexpected[:20]} }")


# --- loss -----------------------------------------------------------------------------------------

def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab: int):
    """Sum of token cross-entropies over the true vocabulary and the valid-token count.

    logits: this TP rank's ``[batch, seq, padded_vocab / tp]``; labels ``[batch, seq]`` with
    IGNORE_INDEX where no loss is taken. Columns at or beyond ``vocab`` are set to -inf."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    logits = logits.float()
    if start + width > vocab:
        pad = torch.arange(start, start + width, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, float("-inf"))
    valid = labels != IGNORE_INDEX
    losses = vocab_parallel_cross_entropy(logits.contiguous(), labels.masked_fill(~valid, 0))
    return (losses * valid).sum(), valid.sum()


def _in_process_write_results() -> None:
    """Our saves are synchronous: megatron's writer runs in this process and reads its own results
    back, so a plain queue does. Megatron's default is a multiprocessing Manager, a server process
    that outlives a rank killed by SIGKILL/SIGTERM and keeps the job's stdout open (the launcher's
    caller then waits forever)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


# --- engine -----------------------------------------------------------------------------------------

class MegatronEngine:
    """The Engine protocol over megatron-core GPTModel chunks, DDP and the distributed optimizer."""

    def __init__(self, cfg: RunConfig, hf_config, hf_state: Mapping[str, torch.Tensor] | None = None):
        from toolkit.families import get_family
        if not torch.cuda.is_available():  # never imported on a GPU machine
            from toolkit.compat import megatron_cpu
            megatron_cpu.enable()  # stays on for the process: megatron allocates lazily, also in backward
        self.cfg, self.hf_config = cfg, hf_config
        self.family = get_family(hf_config.model_type)
        self.plan = check_layout(cfg, hf_config, dist.get_world_size())
        self._init_parallel()
        hf_state = hf_weights(cfg) if hf_state is None else checkpoint_names(self.family, hf_config, hf_state)
        check_hf_keys(self.family, hf_config, hf_state)
        self.tconfig = transformer_config(cfg, hf_config, self.family)
        chunks = build_chunks(cfg, hf_config, self.family, self.tconfig, self.plan["padded_vocab"])
        for c in chunks:
            load_hf_into_chunk(c, self.family, hf_config, hf_state, self.plan["padded_vocab"], cfg.megatron.tp,
                               self.tp_rank)
        del hf_state
        self.model = self._wrap_ddp(chunks)
        self.optimizer = self._build_optimizer()
        self._configure_schedule()
        self._setup_routers()

    # --- setup ----------------------------------------------------------------------------------------

    def _init_parallel(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        m = self.cfg.megatron
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp,
                                         virtual_pipeline_model_parallel_size=m.vpp,
                                         expert_model_parallel_size=m.ep)
        model_parallel_cuda_manual_seed(self.cfg.train.seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        # whether this rank's copy of dense / expert parameters is the one an export takes
        self.owns_dense = self.dp_rank == 0
        self.owns_experts = ps.get_expert_data_parallel_rank() == 0 if m.ep > 1 else self.owns_dense

    def _wrap_ddp(self, chunks) -> list:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True, check_for_nan_in_grad=False)
        return [DistributedDataParallel(self.tconfig, ddp_config, c,
                                        disable_bucketing=i > 0) for i, c in enumerate(chunks)]

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        t, dtype = self.cfg.train, self.cfg.model.dtype
        ocfg = OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                               adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
                               clip_grad=t.grad_clip, use_distributed_optimizer=True,
                               bf16=dtype == "bf16", fp16=dtype == "fp16", params_dtype=DTYPES[dtype])
        return get_megatron_optimizer(ocfg, self.model)

    def _setup_routers(self) -> None:
        """MoE: the routers record their statistics in one ``RouterStats`` (layers by global number)."""
        from toolkit import moe
        experts = self.family.num_experts(self.hf_config)
        self.routers = [m for c in self.model for m in c.modules() if isinstance(m, load_balanced_router_class())]
        self.router_stats = moe.RouterStats(self.hf_config.num_hidden_layers, experts) if experts else None
        self.aux_coeff = moe.aux_loss_coeff(self.cfg.train.moe_aux_loss_coeff, self.hf_config)
        for router in self.routers:
            router.stats = self.router_stats

    def _set_aux_scale(self, loss_tokens: int, micro_batches: int) -> None:
        """Weight of each micro-batch's layer aux loss so that, after the DP sum and the
        ``1 / loss_tokens`` scaling of every gradient, the objective gets ``coeff`` x the mean over
        MoE layers and the global batch's micro-batches (``toolkit/moe.py``)."""
        per = self.aux_coeff * loss_tokens / (self.hf_config.num_hidden_layers * micro_batches * self.dp_size)
        if self.tconfig.grad_scale_func is not None:  # fp16: megatron scales the loss up, every grad down
            per *= float(self.optimizer.get_loss_scale())
        for router in self.routers:
            router.aux_scale = per

    def _configure_schedule(self) -> None:
        from megatron.core.distributed import finalize_model_grads
        self._loss_tokens = 1
        self._complete_grads = False

        def finalize(model, num_tokens=None, **kw):
            # DP sum (no averaging: per-token loss mode); an all-reduce when grads are inspected
            finalize_model_grads(model, num_tokens=None, **{**kw, "force_all_reduce": self._complete_grads})
            for chunk in model:
                chunk.scale_gradients(1.0 / self._loss_tokens)

        self.tconfig.finalize_model_grads_func = finalize
        self.tconfig.grad_scale_func = self.optimizer.scale_loss if self.cfg.model.dtype == "fp16" else None
        no_sync = [c.no_sync for c in self.model]
        self.tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    # --- steps ----------------------------------------------------------------------------------------

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        ids = mb["input_ids"]
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        output = model(ids, positions, None)
        return output, partial(self._loss_func, mb["labels"])

    def _loss_func(self, labels, logits):
        loss_sum, count = vocab_parallel_loss_sum(logits, labels, self.hf_config.vocab_size)
        return loss_sum, count.int(), {"loss_sum": loss_sum.detach().double(), "count": count.double()}

    def _run_schedule(self, micro_batches, forward_only: bool) -> torch.Tensor:
        """Loss sum and token count over this rank's micro-batches (nonzero on the last stage only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        chunks = len(self.model)
        iters = [iter(micro_batches) for _ in range(chunks)]
        mb = micro_batches[0]["input_ids"]
        out = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iters if chunks > 1 else iters[0],
            model=self.model, num_microbatches=len(micro_batches), seq_length=mb.shape[1],
            micro_batch_size=mb.shape[0], forward_only=forward_only)
        totals = torch.zeros(2, dtype=torch.float64)
        if self.is_last_stage and self.tp_rank == 0:  # TP ranks hold the same (reduced) losses
            for d in out:
                totals += torch.stack([d["loss_sum"], d["count"]])
        return totals

    def forward_backward(self, micro_batches, loss_tokens: int, complete_grads: bool = False) -> torch.Tensor:
        """Gradients of sum(token losses) / loss_tokens in the DDP buffers (``param.main_grad``,
        reduce-scattered over DP: each rank's shard is complete; ``complete_grads``: all-reduced,
        so every rank holds the whole gradient, for inspection); returns this rank's [loss sum,
        token count]."""
        self._loss_tokens, self._complete_grads = loss_tokens, complete_grads
        self._set_aux_scale(loss_tokens, len(micro_batches))
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        return self._run_schedule(micro_batches, forward_only=False)

    def train_step(self, micro_batches, loss_tokens, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            # megatron's groups carry wd_mult (0 for biases and norms); its own scheduler applies it,
            # and we replace that scheduler, so apply it here (as DeepSpeed's no-decay group does).
            group["weight_decay"] = self.cfg.train.weight_decay * group.get("wd_mult", 1.0)
        tic = time.perf_counter()
        totals = self.forward_backward(micro_batches, loss_tokens)
        compute_s = time.perf_counter() - tic  # includes pipeline waits: megatron interleaves them
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (inf/nan gradients)")
        dist.all_reduce(totals)  # sums over DP; only one rank per DP replica contributes
        extra = self.router_stats.metrics(len(micro_batches) * self.dp_size) if self.router_stats else {}
        return StepStats(loss=totals[0].item() / loss_tokens, grad_norm=float(grad_norm), compute_s=compute_s,
                         extra=extra)

    @property
    def dp_group(self):
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_group()

    def parameters(self):
        return (p for chunk in self.model for p in chunk.module.parameters())

    def replica_checksum(self) -> float:
        """Order-sensitive float64 checksum of this rank's parameters (equal across its DP group)."""
        total = torch.zeros((), dtype=torch.float64)
        for chunk in self.model:
            for i, p in enumerate(chunk.module.parameters()):
                total += (i + 1) * p.detach().double().sum().cpu()
        return total.item()

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches):
        for chunk in self.model:
            chunk.eval()
        totals = self._run_schedule(micro_batches, forward_only=True) if micro_batches else torch.zeros(2, dtype=torch.float64)
        for chunk in self.model:
            chunk.train()
        dist.all_reduce(totals)
        return totals[0].item(), int(totals[1].item())

    @torch.no_grad()
    def logits(self, micro_batches) -> list[torch.Tensor] | None:
        """Full-vocabulary logits ``[mbs, seq, vocab]`` (padding dropped) per micro-batch, on the last
        pipeline stage's TP rank 0 of every DP replica (each for its own micro-batches); None on
        other ranks. For parity checks."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        vocab = self.hf_config.vocab_size

        def loss_func(output):
            full = gather_from_tensor_model_parallel_region(output)[..., :vocab].float().clone()
            return output.sum() * 0, torch.tensor(1, dtype=torch.int), {"logits": full}

        def step(data_iterator, model):
            mb = next(data_iterator)
            ids = mb["input_ids"]
            return model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), None), loss_func

        for chunk in self.model:
            chunk.eval()
        iters = [iter(micro_batches) for _ in self.model]
        ids = micro_batches[0]["input_ids"]
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters if len(iters) > 1 else iters[0], model=self.model,
            num_microbatches=len(micro_batches), seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
            forward_only=True)
        for chunk in self.model:
            chunk.train()
        mine = self.is_last_stage and self.tp_rank == 0
        return [d["logits"] for d in out] if mine else None

    # --- checkpoints (megatron torch_dist; optimizer fully reshardable) --------------------------------

    def _model_sharded_state_dict(self) -> dict:
        """``model`` (or ``model0``, ``model1``... per virtual stage, as Megatron-LM names them)."""
        return {"model" if len(self.model) == 1 else f"model{i}": chunk.module.sharded_state_dict()
                for i, chunk in enumerate(self.model)}

    def _sharded_state_dict(self, is_loading: bool) -> dict:
        """The model's and the ``optimizer``'s; tensors are keyed by global layer numbers, so any
        layout can load them."""
        sd = self._model_sharded_state_dict()
        # chained_optim_avoid_prefix: with ep > 1 megatron chains a dense and an expert optimizer;
        # without it their keys would differ from ep = 1's and no other ep could load them.
        sd["optimizer"] = self.optimizer.sharded_state_dict(
            dict(sd), is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable",
                                                       "chained_optim_avoid_prefix": True})
        return sd

    def save(self, path: Path, step: int = 0) -> None:
        from megatron.core import dist_checkpointing
        path = Path(path)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        _in_process_write_results()
        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(path))
        if dist.get_rank() == 0:  # after megatron's save, which warns about a folder not empty before it
            (path / "toolkit_megatron.json").write_text(json.dumps(self.describe(), indent=2))
        dist.barrier()

    def _materialize_optimizer_state(self) -> None:
        """A fresh torch Adam has no state (no ``step``) for the checkpoint template to describe;
        one step at lr=0 on zero grads creates it without changing a weight. Loading overwrites it."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            if inner.state:
                continue
            saved_lr = [g["lr"] for g in inner.param_groups]
            for g in inner.param_groups:
                g["lr"] = 0.0
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            inner.step()
            for g, lr in zip(inner.param_groups, saved_lr):
                g["lr"] = lr
                for p in g["params"]:
                    p.grad = None

    def _tolerate_step_state(self) -> None:
        """megatron-core 0.16 with torch's Adam (no Apex/TE): loading the fully reshardable format
        sets ``step`` from the param groups, then copies every state key of each parameter from the
        checkpoint, where ``step`` is not stored per parameter (KeyError). On our instances only,
        copy what the checkpoint has and keep the ``step`` already set."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                continue

            def set_states(model_param, tensors, opt=opt):
                group_index, group_order = opt.model_param_group_index_map[model_param]
                main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
                dst = {"param": main_param, **opt.optimizer.state[main_param]}
                missing = set(dst) - set(tensors) - {"step"}
                if missing:
                    raise RuntimeError(f"checkpoint lacks optimizer state {sorted(missing)}")
                for key, value in tensors.items():
                    dst[key].copy_(value)

            opt._set_main_param_and_optimizer_states = set_states

    def load(self, path: Path) -> None:
        from megatron.core import dist_checkpointing
        if not _holds_optimizer_state(path):  # `toolkit convert --weights-only`: Adam starts fresh
            self._load_weights_only(path)
            return
        self._materialize_optimizer_state()
        self._tolerate_step_state()
        loaded = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(path))
        for i, chunk in enumerate(self.model):
            chunk.module.load_state_dict(loaded["model" if len(self.model) == 1 else f"model{i}"], strict=True)
        self.optimizer.load_state_dict(self._param_groups_as_mine(loaded["optimizer"]))
        self._unshare_step_tensors()

    def _load_weights_only(self, path: Path) -> None:
        """The model's tensors only; the optimizer keeps its fresh state (no moments, step 0) and
        takes its fp32 main weights from the loaded model."""
        from megatron.core import dist_checkpointing
        loaded = dist_checkpointing.load(self._model_sharded_state_dict(), str(path))
        for i, chunk in enumerate(self.model):
            chunk.module.load_state_dict(loaded["model" if len(self.model) == 1 else f"model{i}"], strict=True)
        self.optimizer.reload_model_params()

    def _param_groups_as_mine(self, loaded: dict) -> dict:
        """The loaded optimizer state with the param groups in this optimizer's structure.

        With ep > 1 megatron chains a dense and an expert optimizer; checkpoint tensors are keyed
        alike either way (``chained_optim_avoid_prefix``), but the param groups saved beside them
        are nested per sub-optimizer (``{0: ..., 1: ...}``) or not, as the *saving* run had them. When
        that differs from this run, each sub-optimizer gets its own groups with the saved Adam
        ``step``: the rest of a group (lr, weight decay) the trainer sets every step anyway."""
        subs = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        nested = len(subs) > 1  # megatron reads a single sub-optimizer's state flat
        mine = [loaded[i] for i in range(len(subs))] if nested else [loaded]
        if any(isinstance(k, int) for k in loaded) == nested and all("optimizer" in d for d in mine):
            return loaded  # saved with this structure
        step = _saved_adam_step(loaded)
        for sub, target in zip(subs, mine):
            groups = sub.state_dict()["optimizer"]["param_groups"]
            target["optimizer"] = {"param_groups": [{**g, "step": step} for g in groups]}
            target["param_state_sharding_type"] = "fully_reshardable"
        for key in [k for k in loaded if isinstance(k, int) != nested]:
            del loaded[key]  # the saving structure's entries: flat groups, or per-optimizer ones
        return loaded

    def _unshare_step_tensors(self) -> None:
        """megatron-core 0.16 gives every parameter the *same* ``step`` tensor when it loads a torch
        Adam state; torch increments each parameter's step in place, so a shared one would advance
        once per parameter per step (wrong bias correction). Give each its own copy."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()

    def describe(self) -> dict:
        """What a reader of the checkpoint needs: true vocab, layer spec, layout."""
        return {"format": "megatron-core torch_dist", "family": self.family.model_type,
                "vocab_size": self.hf_config.vocab_size, "padded_vocab_size": self.plan["padded_vocab"],
                "layer_spec": "gpt_layer_local_spec", "optimizer_sharding": "fully_reshardable",
                "layout": self.layout()}

    # --- export ---------------------------------------------------------------------------------------

    def full_mcore_state(self, attr: str | None = None) -> dict[str, torch.Tensor] | None:
        """Full (unsharded, global layer numbers) mcore tensors, on global rank 0; None elsewhere.
        ``attr="main_grad"``: the gradients instead of the weights (complete at dp=1, or after
        ``forward_backward(..., complete_grads=True)``)."""
        local = {}
        for chunk in self.model:
            offset, first_expert = layer_offset(chunk.module), expert_offset(chunk.module)
            for name, t in _local_params(chunk.module).items():
                name = _global_name(name, offset, first_expert)
                if not (self.owns_experts if is_expert(name) else self.owns_dense):
                    continue  # another DP (or expert-DP) replica's copy is taken
                t = getattr(t, attr) if attr else t
                local[name] = t.detach().to("cpu", torch.float32).clone()
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((self.tp_rank, local), gathered, dst=0)
        if dist.get_rank() != 0:
            return None
        return self._merge(gathered)

    def _merge(self, gathered) -> dict[str, torch.Tensor]:
        from toolkit.families import unshard
        parts: dict[str, dict[int, torch.Tensor]] = {}
        for tp_rank, local in gathered:
            for name, t in local.items():
                parts.setdefault(name, {})[tp_rank] = t
        full = {}
        for name, by_rank in parts.items():
            if name == "output_layer.weight" and self.family.tied(self.hf_config):
                continue  # the last stage's copy of the tied embedding
            full[name] = unshard(self.family, self.hf_config, name, [by_rank[r] for r in sorted(by_rank)])
        return full

    def hf_state(self, attr: str | None = None) -> dict[str, torch.Tensor] | None:
        """The current weights (or ``attr`` of them) as an HF state dict on rank 0, strict through
        the family table."""
        from toolkit.families import mcore_to_hf
        full = self.full_mcore_state(attr)
        return None if full is None else mcore_to_hf(self.family, self.hf_config, full, self.plan["padded_vocab"])

    def export_hf(self, path: Path, tokenizer) -> None:
        state = self.hf_state()
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM
            from toolkit.families import pack
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
            model.load_state_dict(pack(self.family, self.hf_config, state), strict=True)
            model.save_pretrained(str(path), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(path))
        dist.barrier()

    def can_load_layout(self, saved: dict) -> bool:
        """torch_dist with a fully reshardable optimizer: megatron reshards any TP/PP/DP on load."""
        return saved.get("format") == "torch_dist"

    def layout(self) -> dict:
        m = self.cfg.megatron
        return {"dp": self.dp_size, "tp": m.tp, "pp": m.pp, "vpp": m.vpp, "ep": m.ep, "format": "torch_dist"}


def _holds_optimizer_state(path: Path) -> bool:
    """Whether a torch_dist checkpoint has optimizer tensors (from its DCP metadata, no tensor read)."""
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(k.startswith("optimizer.") for k in keys)


def _saved_adam_step(loaded: dict) -> float:
    """The one Adam step count of every param group in a loaded optimizer state (flat or nested)."""
    holders = [loaded, *(v for v in loaded.values() if isinstance(v, dict))]
    steps = {g.get("step") for d in holders if isinstance(d.get("optimizer"), dict)
             for g in d["optimizer"].get("param_groups", [])}
    if len(steps) != 1:
        raise RuntimeError(f"the checkpoint's optimizer param groups hold Adam steps {sorted(map(str, steps))}, "
                           "expected exactly one; it was not written by megatron-core's distributed optimizer or "
                           "toolkit convert (resume with --resume never, or convert it again)")
    return steps.pop()


def build_engine(cfg: RunConfig, plan: dict, run_dir: Path, rank: int) -> MegatronEngine:
    """The worker's entry: record the layout plan, build the engine from the run's HF model."""
    from toolkit.adapters.hf import load_hf_config
    if rank == 0:
        (Path(run_dir) / "megatron_layout.json").write_text(json.dumps(plan, indent=2))
    return MegatronEngine(cfg, load_hf_config(cfg.model.name_or_path))
