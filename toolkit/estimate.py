"""Memory and step-time estimate for a run config, before anything is launched.

Memory, per rank, in bytes (Φ = parameters this rank holds, D = data-parallel size):

==============  ==========================================  ==========================================
part            DeepSpeed ZeRO (model built in fp32)         Megatron-core (distributed optimizer)
==============  ==========================================  ==========================================
weights         Φ·w, /D at stage 3 (w = 4 fp32, 2 bf16/fp16) Φ·w (Φ: this rank's TP/PP share)
gradients       Φ·w at stage 0, /D at stage 1-3              Φ·4 (grads reduced in fp32)
optimizer       Adam m, v (8Φ) + fp32 master (4Φ) /D;        Adam m, v (8Φ) + fp32 master when bf16
                stage 0: no master in fp32, nothing sharded  (4Φ), /D
buffers         stage 1-3: reduce_bucket_size x w; stage 3:  -
                + two layers gathered (current, prefetched)
==============  ==========================================  ==========================================

ZeRO-Offload moves the optimizer (and, at stage 2-3, the fp32 gradient partition) to host memory;
``zero.offload_params`` moves the stage-3 weight partition there too.

Activations (the model; documented, not fitted): for one micro-batch of b sequences of s tokens,
per transformer layer, the tensors autograd keeps, in elements per token, with h hidden, I the MLP
width, a heads and t the TP degree::

    4h                     norm inputs and outputs (replicated across TP ranks; 4h / t with
                           megatron.sequence_parallel, which splits them along the sequence)
    5h / t                 q, k, v after RoPE (K/V heads repeated to all heads: HF's sdpa path and
                           Megatron's local attention both expand GQA), the attention output and
                           its contiguous copy that feeds the output projection
    4I / t                 SwiGLU gate, up, act(gate), act(gate)*up   (2I for a plain GELU MLP)
    a·s / t                attention probabilities, only when they are materialized (Megatron's
                           local attention, HF eager); HF's sdpa/flash kernels keep none

times the activation dtype's bytes. Outside the layers: logits, their log-softmax and the logits'
gradient, 3 x 4 bytes x b·s·V/t (the loss is taken in fp32). With activation checkpointing only each
layer's input (h per token, h / t with sequence parallelism) is kept, plus one layer's full
activations while it is recomputed.
DeepSpeed runs one micro-batch at a time; Megatron's 1F1B keeps up to pp micro-batches in flight on
the first stage (so its layers x pp, i.e. all layers' worth when pp divides evenly).

Step time (alpha-beta model, no overlap of communication with compute, an upper bound): a
collective over p ranks moving n bytes costs, with latency α and bandwidth β of the slowest link
the group crosses (intra-node when all its ranks share a node, else inter-node)::

    all-reduce       2(p-1)·α + 2(p-1)/p · n/β
    reduce-scatter   (p-1)·α + (p-1)/p · n/β        all-gather: the same
    p2p              α + n/β

Per optimizer step: ZeRO-0/1 all-reduce the gradients (ZeRO-1 then all-gathers the updated
weights); ZeRO-2 reduce-scatters gradients and all-gathers weights; ZeRO-3 all-gathers weights twice
(forward, backward) and reduce-scatters gradients every micro-batch. Megatron: 4 all-reduces of
b·s·h activations per layer per micro-batch over TP (2 forward, 2 backward); pipeline p2p of b·s·h
per micro-batch each way; the DP reduce-scatter of fp32 gradients and all-gather of weights; the
pipeline bubble (pp-1)/m of the compute (m micro-batches). Compute: 6·N·tokens + 12·L·h·s·tokens
FLOPs (8·N with full recompute), at ``mfu`` of the device's dense peak. Ranks are placed TP-first
then DP then PP (Megatron's order), TP innermost on a node.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from toolkit.config import ConfigError, RunConfig

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
USABLE = 0.92  # of device memory: the rest goes to the CUDA context, NCCL buffers and fragmentation


# --- model shape --------------------------------------------------------------------------------

@dataclass
class Shape:
    """Parameter counts by where they live, from the HF model built on the meta device."""
    embedding: int
    output: int  # lm_head when untied, else 0
    per_layer: list[int]  # each layer's parameters
    per_layer_matrices: list[int]  # of which 2-D (TP splits these; norms are replicated)
    other: int  # final norm, learned positions
    layers: int
    hidden: int
    kv_width: int
    mlp_width: int
    glu: bool
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    per_layer_experts: list[int] = field(default_factory=list)
    """Mixture of experts: each layer's routed experts' parameters (part of per_layer_matrices)."""
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)..."""
    experts_per_token: int = 0
    """...of which each token uses this many."""

    @property
    def total(self) -> int:
        return self.embedding + self.output + sum(self.per_layer) + self.other


def model_shape(hf_config) -> Shape:
    """Count every parameter of the HF model without allocating it (meta device)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = emb is out
    per_layer = [0] * hf_config.num_hidden_layers
    matrices = [0] * hf_config.num_hidden_layers
    experts = [0] * hf_config.num_hidden_layers
    other = 0
    for name, p in model.named_parameters():  # tied weights are listed once
        if p is emb or p is out:
            continue
        layer = re.search(r"\.(\d+)\.", name)
        if layer is None:
            other += p.numel()
            continue
        per_layer[int(layer.group(1))] += p.numel()
        matrices[int(layer.group(1))] += p.numel() if p.ndim >= 2 else 0
        experts[int(layer.group(1))] += p.numel() if ".experts." in name else 0  # transformers' routed experts
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    kv = kv_heads * head_dim
    act = str(getattr(hf_config, "hidden_act", getattr(hf_config, "activation_function", "gelu")))
    mlp = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None) or 4 * hf_config.hidden_size
    return Shape(embedding=emb.numel(), output=0 if tied else out.numel(), per_layer=per_layer,
                 per_layer_matrices=matrices, other=other, layers=hf_config.num_hidden_layers,
                 hidden=hf_config.hidden_size, kv_width=kv, mlp_width=mlp, glu="silu" in act or "swiglu" in act,
                 heads=heads, kv_heads=kv_heads, vocab=hf_config.vocab_size, tied=tied, per_layer_experts=experts,
                 experts=_routed_experts(hf_config) if any(experts) else 0,
                 experts_per_token=int(getattr(hf_config, "num_experts_per_tok", 0) or 0) if any(experts) else 0)


def _routed_experts(hf_config) -> int:
    """transformers' MoE configs name it num_local_experts (Mixtral) or num_experts (Qwen-MoE, OLMoE)."""
    return int(getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0)


# --- layout -------------------------------------------------------------------------------------

@dataclass
class Layout:
    """One way to run the config: the knobs the estimate depends on."""
    backend: str
    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    recompute: str = "none"  # none | selective | full (DeepSpeed: full = HF gradient checkpointing)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    ep: int = 1  # megatron expert parallelism: routed experts split over ep of the dp ranks

    def describe(self) -> str:
        if self.backend == "deepspeed":
            off = "+offload_opt" if self.offload_optimizer else ""
            off += "+offload_params" if self.offload_params else ""
            return f"ZeRO-{self.zero_stage}{off} dp={self.dp} ckpt={self.recompute}"
        return f"tp={self.tp} pp={self.pp} dp={self.dp}" + (f" ep={self.ep}" if self.ep > 1 else "") + \
            f" recompute={self.recompute}"


def layout_of(cfg: RunConfig, world: int) -> Layout:
    if cfg.backend == "deepspeed":
        return Layout("deepspeed", world, dp=world, zero_stage=cfg.zero.stage, offload_optimizer=cfg.zero.offload_optimizer,
                      offload_params=cfg.zero.offload_params,
                      recompute="full" if cfg.model.activation_checkpointing else "none")
    m = cfg.megatron
    return Layout("megatron", world, dp=world // (m.tp * m.pp), tp=m.tp, pp=m.pp, recompute=m.recompute,
                  first_stage_layers=m.first_stage_layers, last_stage_layers=m.last_stage_layers, ep=m.ep)


def stage_layers(shape: Shape, lay: Layout) -> list[list[int]]:
    """Global layer indices on each pipeline stage (even split, or the uneven first/last counts)."""
    first, last, pp, n = lay.first_stage_layers, lay.last_stage_layers, lay.pp, shape.layers
    if pp == 1:
        return [list(range(n))]
    counts = [None] * pp
    counts[0], counts[-1] = first, last
    rest = n - sum(c for c in counts if c is not None)
    free = sum(c is None for c in counts)
    counts = [c if c is not None else rest // free for c in counts]
    starts = [sum(counts[:i]) for i in range(pp)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


# --- memory -------------------------------------------------------------------------------------

@dataclass
class Memory:
    """Bytes on one rank (the fullest one), by part; ``host`` is what offload puts in CPU memory."""
    weights: float
    gradients: float
    optimizer: float
    buffers: float
    activations: float
    activations_no_ckpt: float
    activations_ckpt: float
    host: float
    params: int  # parameters this rank holds a slice or copy of (before ZeRO partitioning)

    @property
    def model_state(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.model_state + self.buffers + self.activations


def memory(cfg: RunConfig, shape: Shape, lay: Layout, bucket: int | None = None) -> Memory:
    """Per-rank memory of the fullest rank; the formulas are in this module's docstring.

    ``bucket``: DeepSpeed's zero_optimization.reduce_bucket_size (elements) from the resolved JSON;
    default hidden^2, what "auto" resolves to."""
    w = DTYPE_BYTES[cfg.model.dtype]
    if lay.backend == "deepspeed":
        return _deepspeed_memory(cfg, shape, lay, w, bucket or shape.hidden ** 2)
    return max((_megatron_stage_memory(cfg, shape, lay, w, i) for i in range(lay.pp)), key=lambda m: m.total)


def _deepspeed_memory(cfg: RunConfig, shape: Shape, lay: Layout, w: int, bucket: int) -> Memory:
    phi, d, stage = shape.total, lay.dp, lay.zero_stage
    weights = phi * w / (d if stage == 3 else 1)
    # Measured (tests/test_estimate.py): DeepSpeed's ZeRO-1 also reduces each bucket into this
    # rank's partition as backward goes, so after any backward only the partition is left.
    grads = phi * w / (d if stage >= 1 else 1)
    master = 4 if (w != 4 or stage >= 1) else 0  # ZeRO 1-3 keep an fp32 partition even of fp32 weights
    optim = (8 + master) * phi / (d if stage >= 1 else 1)
    # ZeRO 1-3 reduce gradients through a reduce_bucket_size bucket (2 GB in fp32 at DeepSpeed's
    # 5e8 default: it matters); stage 3 also gathers the current and the prefetched layer.
    buffers = 0 if stage == 0 else bucket * w + (2 * max(shape.per_layer, default=0) * w if stage == 3 else 0)
    host = 0.0
    if lay.offload_optimizer:
        host += optim + (grads if stage >= 2 else 0)
        optim, grads = 0.0, (0.0 if stage >= 2 else grads)
    if lay.offload_params and stage == 3:
        host += weights
        weights = 0.0
    acts = {r: _activations(cfg, shape, list(range(shape.layers)), 1, 1, r, w, materialized=False)
            for r in ("none", "full")}
    return Memory(weights, grads, optim, buffers, acts[lay.recompute if lay.recompute in acts else "none"],
                  acts["none"], acts["full"], host, phi)


def _megatron_stage_memory(cfg: RunConfig, shape: Shape, lay: Layout, w: int, stage: int) -> Memory:
    from toolkit.families import padded_vocab_size
    t, stages = lay.tp, stage_layers(shape, lay)
    layers = stages[stage]
    vocab = padded_vocab_size(shape.vocab, cfg.megatron.make_vocab_size_divisible_by, t)
    first, last = stage == 0, stage == lay.pp - 1
    experts = [shape.per_layer_experts[i] if shape.per_layer_experts else 0 for i in layers]
    phi = sum((shape.per_layer_matrices[i] - e) / t + shape.per_layer[i] - shape.per_layer_matrices[i]
              for i, e in zip(layers, experts))
    phi += vocab * shape.hidden / t * (first + (last and (not shape.tied or lay.pp > 1)))
    phi += shape.other if last else 0
    expert_phi = sum(experts) / (t * lay.ep)  # expert tensor parallelism = tp
    # the distributed optimizer shards dense state over dp, experts' over the dp / ep expert replicas
    optim = (8 + (4 if w != 4 else 0)) * (phi / lay.dp + expert_phi / (lay.dp // lay.ep))
    phi += expert_phi
    in_flight = min(lay.pp - stage, _micro_batches(cfg, lay))
    sp = cfg.megatron.sequence_parallel and t > 1
    acts = {r: _activations(cfg, shape, layers, t, in_flight, r, w, materialized=True, logits=last, sp=sp)
            for r in ("none", "selective", "full")}
    return Memory(phi * w, phi * 4, optim, 0.0, acts[lay.recompute], acts["none"], acts["full"], 0.0, int(phi))


def _micro_batches(cfg: RunConfig, lay: Layout) -> int:
    return max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * lay.dp))


def _activations(cfg: RunConfig, shape: Shape, layers: list[int], t: int, in_flight: int, recompute: str,
                 w: int, materialized: bool, logits: bool = True, sp: bool = False) -> float:
    """Bytes autograd keeps for ``in_flight`` micro-batches on these layers (see the module docstring);
    ``sp``: sequence parallelism splits the norms' tensors and the layer inputs over the t TP ranks."""
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len
    h, mlp = shape.hidden, shape.mlp_width
    split = t if sp else 1
    scores = shape.heads * s / t if materialized and recompute != "selective" else 0
    per_token = 4 * h / split + 5 * h / t + (4 if shape.glu else 2) * mlp / t + scores
    layer = per_token * b * s * w
    kept = len(layers) * (b * s * h / split * w if recompute == "full" else layer) * in_flight
    recomputing = layer if recompute == "full" else 0  # one layer's full activations during its backward
    head = 3 * 4 * b * s * shape.vocab / t if logits else 0
    return kept + recomputing + head


# --- fit and suggestions ----------------------------------------------------------------------------

def fits(mem: Memory, device_gib: float) -> bool:
    return mem.total <= USABLE * device_gib * GiB


def candidate_layouts(cfg: RunConfig, shape: Shape, world: int) -> list[Layout]:
    """Every layout of this backend at this world size, least sharding / recompute first."""
    out: list[Layout] = []
    if cfg.backend == "deepspeed":
        for recompute in ("none", "full"):
            for stage in (0, 1, 2, 3):
                out.append(Layout("deepspeed", world, world, zero_stage=stage, recompute=recompute))
            out += [Layout("deepspeed", world, world, zero_stage=s, offload_optimizer=True, recompute=recompute)
                    for s in (2, 3)]
            out.append(Layout("deepspeed", world, world, zero_stage=3, offload_optimizer=True,
                              offload_params=True, recompute=recompute))
        return out
    for recompute in ("none", "selective", "full"):
        for mp in sorted({tp * pp for tp in _divisors(world) for pp in _divisors(world // tp)}):
            for tp in _divisors(mp):
                pp = mp // tp
                if shape.heads % tp or shape.kv_heads % tp or shape.layers % pp or world % mp:
                    continue
                ep = cfg.megatron.ep if (world // mp) % cfg.megatron.ep == 0 else 1
                out.append(Layout("megatron", world, world // mp, tp=tp, pp=pp, recompute=recompute, ep=ep))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggestions(cfg: RunConfig, shape: Shape, world: int, device_gib: float, bucket: int | None = None,
                limit: int = 3) -> list[tuple[Layout, Memory]]:
    found = []
    for lay in candidate_layouts(cfg, shape, world):
        mem = memory(cfg, shape, lay, bucket)
        if fits(mem, device_gib):
            found.append((lay, mem))
        if len(found) == limit:
            break
    return found


# --- step time: alpha-beta model ----------------------------------------------------------------------

class Cluster(BaseModel):
    """A cluster description for the step-time model; defaults are an 8-GPU H100/H200 SXM node."""
    model_config = ConfigDict(extra="forbid")
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    intra_gbps: float = Field(450.0, gt=0, description="GB/s per GPU inside a node (NVLink 4, one direction)")
    inter_gbps: float = Field(50.0, gt=0, description="GB/s per GPU across nodes (one 400 Gb/s NIC per GPU)")
    intra_latency_us: float = Field(5.0, ge=0)
    inter_latency_us: float = Field(10.0, ge=0)
    peak_tflops: float | None = Field(None, gt=0, description="dense peak per GPU; default by dtype (H100 SXM)")
    mfu: float = Field(0.4, gt=0, le=1, description="share of peak the compute reaches")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


PEAK_TFLOPS = {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}  # H100/H200 SXM dense; fp32 runs as TF32


@dataclass
class Collective:
    kind: str  # all-reduce | reduce-scatter | all-gather | p2p
    group: str  # dp | tp | pp | embedding
    ranks: int
    nbytes: float
    count: int
    inter_node: bool
    seconds: float = 0.0


@dataclass
class StepTime:
    compute_s: float
    bubble_s: float
    collectives: list[Collective] = field(default_factory=list)

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.total_s if self.total_s else 0.0


def collective_seconds(kind: str, p: int, nbytes: float, alpha: float, beta: float) -> float:
    """The alpha-beta cost of one ring collective over p ranks (alpha in s, beta in bytes/s)."""
    if p <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta
    if kind in ("reduce-scatter", "all-gather"):
        return (p - 1) * alpha + (p - 1) / p * nbytes / beta
    return alpha + nbytes / beta  # p2p


def step_time(cfg: RunConfig, shape: Shape, lay: Layout, cluster: Cluster) -> StepTime:
    w = DTYPE_BYTES[cfg.model.dtype]
    m = _micro_batches(cfg, lay)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    matmul_params = shape.total - shape.embedding + (shape.embedding if shape.tied else 0)
    per_token = (8 if lay.recompute == "full" else 6) * matmul_params + 12 * shape.layers * shape.hidden * cfg.data.seq_len
    peak = (cluster.peak_tflops or PEAK_TFLOPS[cfg.model.dtype]) * 1e12 * cluster.mfu
    compute = per_token * tokens / lay.world / peak
    bubble = compute * (lay.pp - 1) / m
    g = cluster.gpus_per_node
    colls = _deepspeed_collectives(shape, lay, w, m, g) if lay.backend == "deepspeed" else \
        _megatron_collectives(cfg, shape, lay, w, m, g)
    for c in colls:
        c.inter_node = c.inter_node and cluster.nodes > 1
        alpha = (cluster.inter_latency_us if c.inter_node else cluster.intra_latency_us) * 1e-6
        beta = (cluster.inter_gbps if c.inter_node else cluster.intra_gbps) * 1e9
        c.seconds = c.count * collective_seconds(c.kind, c.ranks, c.nbytes, alpha, beta)
    return StepTime(compute, bubble, colls)


def _deepspeed_collectives(shape: Shape, lay: Layout, w: int, m: int, g: int) -> list[Collective]:
    n, d = shape.total * w, lay.dp
    plan = {0: [("all-reduce", 1)], 1: [("all-reduce", 1), ("all-gather", 1)],
            2: [("reduce-scatter", 1), ("all-gather", 1)], 3: [("all-gather", 2 * m), ("reduce-scatter", m)]}
    return [Collective(kind, "dp", d, n, count, d > g) for kind, count in plan[lay.zero_stage] if d > 1]


def _megatron_collectives(cfg: RunConfig, shape: Shape, lay: Layout, w: int, m: int, g: int) -> list[Collective]:
    act = cfg.train.micro_batch_size * cfg.data.seq_len * shape.hidden * w
    layers = max(len(s) for s in stage_layers(shape, lay))
    tp_per_layer = 6 if lay.recompute == "full" else 4  # recompute repeats the 2 forward all-reduces
    phi = memory(cfg, shape, lay).params
    out = [Collective("all-reduce", "tp", lay.tp, act, m * layers * tp_per_layer, lay.tp > g),
           Collective("p2p", "pp", lay.pp, act, 2 * m if lay.pp > 1 else 0, lay.tp * lay.dp >= g),
           Collective("reduce-scatter", "dp", lay.dp, phi * 4, 1, lay.tp * lay.dp > g),
           Collective("all-gather", "dp", lay.dp, phi * w, 1, lay.tp * lay.dp > g)]
    if shape.tied and lay.pp > 1:
        out.append(Collective("all-reduce", "embedding", 2, shape.embedding / lay.tp * 4, 1, lay.tp * lay.dp >= g))
    return [c for c in out if c.ranks > 1 and c.count > 0]


# --- the whole estimate -----------------------------------------------------------------------------

def estimate(cfg: RunConfig, cluster: Cluster, device_gib: float) -> dict:
    """Memory per rank, fit, smallest fitting layouts and step time at ``cluster``; JSON-able."""
    from toolkit.worker import resolve_for_world
    world = cluster.world
    hf_config, backend_config = resolve_for_world(cfg, world)  # the same checks and messages as a launch
    shape = model_shape(hf_config)
    lay = layout_of(cfg, world)
    bucket = int((backend_config or {}).get("zero_optimization", {}).get("reduce_bucket_size", 0)) \
        if cfg.backend == "deepspeed" else None
    mem = memory(cfg, shape, lay, bucket)
    return {
        "model": {"model_type": hf_config.model_type, "params": shape.total, "layers": shape.layers,
                  "hidden": shape.hidden, "vocab": shape.vocab, "tied": shape.tied},
        "layout": asdict(lay), "layout_text": lay.describe(), "cluster": cluster.model_dump(),
        "memory": {**asdict(mem), "model_state": mem.model_state, "total": mem.total},
        "device_gib": device_gib, "fits": fits(mem, device_gib),
        "suggestions": [{"layout": fit.describe(), "total_gib": m.total / GiB}
                        for fit, m in suggestions(cfg, shape, world, device_gib, bucket)],
        "step": _step_dict(step_time(cfg, shape, lay, cluster)),
        "scaling": _scaling(cfg, shape, lay, cluster),
    }


def _step_dict(t: StepTime) -> dict:
    return {"compute_s": t.compute_s, "bubble_s": t.bubble_s, "comm_s": t.comm_s, "total_s": t.total_s,
            "comm_share": t.comm_share, "collectives": [asdict(c) for c in t.collectives]}


def _scaling(cfg: RunConfig, shape: Shape, lay: Layout, cluster: Cluster) -> list[dict]:
    """Step time as nodes are added (DP grows, global batch fixed) while every DP rank has a micro-batch."""
    rows = []
    for nodes in (2**k for k in range(0, 11)):
        world = nodes * cluster.gpus_per_node
        if world % (lay.tp * lay.pp):
            continue
        grown = Layout(**{**asdict(lay), "world": world, "dp": world // (lay.tp * lay.pp)})
        if cfg.train.global_batch_size < cfg.train.micro_batch_size * grown.dp:
            break
        t = step_time(cfg, shape, grown, cluster.model_copy(update={"nodes": nodes}))
        rows.append({"nodes": nodes, "gpus": world, "step_s": t.total_s, "comm_share": t.comm_share})
    return rows


def print_estimate(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    import sys
    # Off a terminal rich assumes 80 columns and wraps the tables; logs and pipes can take more.
    console = Console(width=None if sys.stdout.isatty() else 120)
    mem, model = result["memory"], result["model"]
    console.print(f"model: {model['model_type']}, {model['params'] / 1e6:,.2f} M parameters, {model['layers']} layers, "
                  f"hidden {model['hidden']}, vocab {model['vocab']}{' (tied)' if model['tied'] else ''}")
    c = result["cluster"]
    console.print(f"layout: {result['layout_text']} on {c['nodes']} node(s) x {c['gpus_per_node']} = "
                  f"{result['layout']['world']} ranks")
    table = Table("per rank (fullest)", "GiB", title="memory (formulas: toolkit/estimate.py)")
    for key, label in (("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
                       ("buffers", "buffers"), ("activations_no_ckpt", "activations, no checkpointing"),
                       ("activations_ckpt", "activations, with checkpointing"), ("activations", "activations, as set"),
                       ("total", "total"), ("host", "host memory (offload)")):
        table.add_row(label, f"{mem[key] / GiB:,.3f}")
    console.print(table)
    verdict = "fits" if result["fits"] else "does NOT fit"
    console.print(f"{verdict} in {result['device_gib']:g} GiB per device ({USABLE:.0%} usable)")
    for s in result["suggestions"]:
        console.print(f"  fits: {s['layout']}  ({s['total_gib']:,.2f} GiB)")
    if not result["suggestions"]:
        console.print("  no layout of this backend fits at this world size: add devices, shorten data.seq_len, "
                      "or lower train.micro_batch_size")
    _print_step(console, result)


def _print_step(console, result: dict) -> None:
    from rich.table import Table
    step = result["step"]
    table = Table("part", "count", "bytes each", "link", "seconds", title="step time (alpha-beta model, no overlap)")
    table.add_row("compute", "", "", "", _secs(step["compute_s"]))
    if step["bubble_s"]:
        table.add_row("pipeline bubble", "", "", "", _secs(step["bubble_s"]))
    for col in step["collectives"]:
        table.add_row(f"{col['kind']} ({col['group']}, {col['ranks']} ranks)", str(col["count"]),
                      f"{col['nbytes'] / 2**20:,.2f} MiB", "inter-node" if col["inter_node"] else "intra-node",
                      _secs(col["seconds"]))
    table.add_row("total", "", "", "", f"{_secs(step['total_s'])}  (communication {step['comm_share']:.0%})")
    console.print(table)
    console.print("scaling (DP grows, same global batch): " + ", ".join(
        f"{r['nodes']} node(s) {_secs(r['step_s'])} ({r['comm_share']:.0%} comm)" for r in result["scaling"]))


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


# --- entry points (toolkit estimate, toolkit train --dry-run) ---------------------------------------

def parse_cluster(nodes: int, gpus_per_node: int, items: list[str]) -> Cluster:
    """``--cluster key=value`` items on top of the node counts; errors name the key and the fix."""
    import yaml
    from pydantic import ValidationError
    raw: dict = {"nodes": nodes, "gpus_per_node": gpus_per_node}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in Cluster.model_fields:
            raise ConfigError(f"--cluster {item!r}: expected KEY=VALUE with KEY one of {', '.join(Cluster.model_fields)}")
        raw[key] = yaml.safe_load(value)
    try:
        return Cluster.model_validate(raw)
    except ValidationError as exc:
        errs = [f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("invalid cluster description: " + "; ".join(errs)) from None


def default_device_gib() -> tuple[float, str]:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB, "this machine's GPU 0"
    return 80.0, "assumed (no GPU here): pass --device-memory GiB"


def run_estimate(cfg: RunConfig, cluster: Cluster, device_gib: float | None, as_json: bool) -> int:
    import json
    source = "--device-memory"
    if device_gib is None:
        device_gib, source = default_device_gib()
    if device_gib <= 0:
        raise ConfigError(f"--device-memory={device_gib}: must be > 0 GiB, e.g. --device-memory 80")
    result = estimate(cfg, cluster, device_gib)
    result["device_source"] = source
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_estimate(result)
    return 0 if result["fits"] else 3


def dry_run(cfg: RunConfig, nnodes: int, device_gib: float | None = None) -> int:
    """Print everything a launch would resolve, then the estimate; start no process, read no data."""
    import json

    import yaml

    from toolkit.worker import resolve_for_world
    world = cfg.nproc * nnodes
    _, backend_config = resolve_for_world(cfg, world)
    print("# resolved run config (written to RUN_DIR/config.yaml at launch)")
    print(yaml.safe_dump(cfg.model_dump(), sort_keys=False), end="")
    title = "DeepSpeed config (RUN_DIR/ds_config.json)" if cfg.backend == "deepspeed" else "Megatron layout"
    print(f"# {title}\n{json.dumps(backend_config, indent=2)}")
    print(f"# estimate: {world} rank(s) = {nnodes} node(s) x {cfg.nproc}")
    run_estimate(cfg, Cluster(nodes=nnodes, gpus_per_node=cfg.nproc), device_gib, as_json=False)
    print("toolkit: dry run - no process group was started and no data was read")
    return 0
