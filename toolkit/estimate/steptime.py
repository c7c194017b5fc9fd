"""Step time of a planned run (alpha-beta model, no overlap of communication with compute, an upper bound): a
collective over p ranks moving n bytes costs, with latency α and bandwidth β of the slowest link
the group crosses (intra-node when all its ranks share a node, else inter-node)::

    all-reduce       2(p-1)·α + 2(p-1)/p · n/β
    reduce-scatter   (p-1)·α + (p-1)/p · n/β        all-gather, all-to-all: the same
    p2p              α + n/β

Per optimizer step: ZeRO-0/1 all-reduce the gradients (ZeRO-1 then all-gathers the updated
weights); ZeRO-2 reduce-scatters gradients and all-gathers weights; ZeRO-3 all-gathers weights twice
(forward, backward) and reduce-scatters gradients every micro-batch. Megatron: 4 all-reduces of
b·s·h activations per layer per micro-batch over TP (2 forward, 2 backward); pipeline p2p of b·s·h
per micro-batch each way; the DP reduce-scatter of fp32 gradients and all-gather of weights; the
pipeline bubble (pp-1)/m of the compute (m micro-batches). Context parallelism (c = megatron.cp):
activations of b·s/c tokens per rank, an all-to-all of q, k, v and the attention output per layer
forward and backward (again when recomputed) over the c ranks, the DP collectives over dp·c. Compute: 6·N·tokens + 12·L·h·s·tokens
FLOPs (8·N with full recompute), at ``mfu`` of the device's dense peak. Ranks are placed TP-first
then CP then DP then PP (Megatron's order), TP innermost on a node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from toolkit.config import RunConfig
from toolkit.estimate.flops import PEAK_TFLOPS
from toolkit.estimate.memory import DTYPE_BYTES, memory, micro_batches
from toolkit.estimate.moe import MoeShape, all_to_all_passes, dispatch_bytes, moe_shape, zero_ep
from toolkit.layout import Layout, kv_copies, stage_layers
from toolkit.plan.model import ModelSpec

DEFAULT_GPU = "H100"
"""The device whose peak the step time assumes without ``--cluster peak_tflops=...``."""


class Cluster(BaseModel):
    """A cluster description for the step-time model; defaults are an 8-GPU H100/H200 SXM node."""
    model_config = ConfigDict(extra="forbid")
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    intra_gbps: float = Field(450.0, gt=0, description="GB/s per GPU inside a node (NVLink 4, one direction)")
    inter_gbps: float = Field(50.0, gt=0, description="GB/s per GPU across nodes (one 400 Gb/s NIC per GPU)")
    intra_latency_us: float = Field(5.0, ge=0)
    inter_latency_us: float = Field(10.0, ge=0)
    peak_tflops: float | None = Field(None, gt=0, description="dense peak per GPU; default by dtype (H100 SXM, "
                                      "toolkit.estimate.flops)")
    mfu: float = Field(0.4, gt=0, le=1, description="share of peak the compute reaches")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Collective:
    kind: str  # all-reduce | reduce-scatter | all-gather | all-to-all | p2p
    group: str  # dp | tp | pp | cp | sp | embedding
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
    if kind in ("reduce-scatter", "all-gather", "all-to-all"):  # all-to-all: each rank keeps 1 / p, sends the rest
        return (p - 1) * alpha + (p - 1) / p * nbytes / beta
    return alpha + nbytes / beta  # p2p


def step_time(cfg: RunConfig, spec: ModelSpec, lay: Layout, cluster: Cluster, ep: int | None = None) -> StepTime:
    """``ep``: DeepSpeed's expert parallelism (default ``zero.ep``; ``estimate/moe.py``)."""
    w = DTYPE_BYTES[cfg.model.dtype]
    m = micro_batches(cfg, lay)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    matmul_params = spec.total - spec.embedding + (spec.embedding if spec.tied else 0)
    per_token = (8 if lay.recompute == "full" else 6) * matmul_params + 12 * spec.layers * spec.hidden * cfg.data.seq_len
    peak = (cluster.peak_tflops or PEAK_TFLOPS[DEFAULT_GPU][cfg.model.dtype]) * 1e12 * cluster.mfu
    compute = per_token * tokens / lay.world / peak
    bubble = compute * (lay.pp - 1) / m
    g = cluster.gpus_per_node
    colls = _deepspeed_collectives(cfg, spec, lay, w, m, g, zero_ep(cfg) if ep is None else ep) \
        if lay.backend == "deepspeed" else \
        _megatron_collectives(cfg, spec, lay, w, m, g)
    for c in colls:
        c.inter_node = c.inter_node and cluster.nodes > 1
        alpha = (cluster.inter_latency_us if c.inter_node else cluster.intra_latency_us) * 1e-6
        beta = (cluster.inter_gbps if c.inter_node else cluster.intra_gbps) * 1e9
        c.seconds = c.count * collective_seconds(c.kind, c.ranks, c.nbytes, alpha, beta)
    return StepTime(compute, bubble, colls)


def _deepspeed_collectives(cfg: RunConfig, spec: ModelSpec, lay: Layout, w: int, m: int, g: int,
                           ep: int = 1) -> list[Collective]:
    """``ep`` > 1 (AutoEP): the experts' E / ep on each rank, their ZeRO collectives over the d / ep
    expert-data-parallel ranks, the tokens' all-to-all over ep (``estimate/moe.py``)."""
    shape = moe_shape(spec) if ep > 1 else None
    experts = shape.params if shape else 0
    n, d = (spec.total - experts) * w, lay.dp * lay.sp  # ZeRO spans the whole dp x sp world
    plan = {0: [("all-reduce", 1)], 1: [("all-reduce", 1), ("all-gather", 1)],
            2: [("reduce-scatter", 1), ("all-gather", 1)], 3: [("all-gather", 2 * m), ("reduce-scatter", m)]}
    out = [Collective(kind, "dp", d, n, count, d > g) for kind, count in plan[lay.zero_stage] if d > 1]
    if shape:
        e = d // ep  # the ranks holding the same experts
        out += [Collective(kind, "expert-dp", e, experts / ep * w, count, d > g)
                for kind, count in plan[lay.zero_stage] if e > 1]
        out.append(Collective("all-to-all", "ep", ep, dispatch_bytes(cfg, spec, w, lay.sp),
                              all_to_all_passes(lay.recompute) * m * shape.layers, ep > g))
    if lay.sp > 1:  # Ulysses: q, k, v to heads and the output back per layer; again in the backward (and recompute)
        tokens = cfg.train.micro_batch_size * cfg.data.seq_len // lay.sp
        nbytes = tokens * (2 * spec.heads * spec.head_dim + 2 * spec.kv_width) * w
        passes = 3 if lay.recompute == "full" else 2
        out.append(Collective("all-to-all", "sp", lay.sp, nbytes, passes * m * spec.layers, lay.sp > g))
    return out


def _megatron_collectives(cfg: RunConfig, spec: ModelSpec, lay: Layout, w: int, m: int, g: int) -> list[Collective]:
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len / lay.cp  # this rank's share of each row
    act = tokens * spec.hidden * w
    layers = max(len(s) for s in stage_layers(spec.layers, lay))
    tp_per_layer = 6 if lay.recompute == "full" else 4  # recompute repeats the 2 forward all-reduces
    phi = memory(cfg, spec, lay).params
    shards, mp = lay.dp * lay.cp, lay.tp * lay.cp  # megatron's rank order: tp, cp, (ep), dp, pp
    shape = moe_shape(spec)
    expert_phi = shape.params * layers / spec.layers / (lay.tp * lay.ep) if shape else 0  # this rank's experts
    # megatron-core 0.16 chains a dense and an expert distributed optimizer at ep > 1, and each one's step
    # all-gathers every bucket of the model (DDP.start_param_sync): the weights go round twice
    # (benchmarks/moe_ep.py measures it)
    gathers = 2 if shape and lay.ep > 1 else 1
    out = [Collective("all-reduce", "tp", lay.tp, act, m * layers * tp_per_layer, lay.tp > g),
           Collective("p2p", "pp", lay.pp, act, 2 * m if lay.pp > 1 else 0, mp * lay.dp >= g),
           Collective("reduce-scatter", "dp", shards, (phi - expert_phi) * 4, 1, lay.tp * shards > g),
           Collective("all-gather", "dp", shards, (phi - expert_phi) * w, gathers, lay.tp * shards > g)]
    if shape:  # expert gradients over the dp x cp / ep replicas of each expert, and the token dispatcher
        replicas = shards // lay.ep
        out += [Collective("reduce-scatter", "expert-dp", replicas, expert_phi * 4, 1, lay.tp * shards > g),
                Collective("all-gather", "expert-dp", replicas, expert_phi * w, gathers, lay.tp * shards > g)]
        out += _megatron_dispatcher(cfg, spec, lay, shape, w, m, layers, g)
    if lay.cp > 1:  # q, k, v to heads and the output back, per layer forward and backward (again when recomputed)
        kv = spec.kv_width * kv_copies(spec.kv_heads // lay.tp, lay.cp)
        qkvo = tokens * (2 * spec.hidden + 2 * kv) / lay.tp * w
        out.append(Collective("all-to-all", "cp", lay.cp, qkvo, m * layers * (3 if lay.recompute == "full" else 2),
                              mp > g))
    if spec.tied and lay.pp > 1:
        out.append(Collective("all-reduce", "embedding", 2, spec.embedding / lay.tp * 4, 1, lay.tp * lay.dp >= g))
    return [c for c in out if c.ranks > 1 and c.count > 0]


def _megatron_dispatcher(cfg: RunConfig, spec: ModelSpec, lay: Layout, shape: MoeShape, w: int, m: int, layers: int,
                         g: int) -> list[Collective]:
    """megatron's MoE token dispatcher per micro-batch over the stage's MoE layers (``estimate/moe.py``).
    ``allgather`` over the tp x ep group: forward all-gathers of the routing map (bytes), the routing
    probabilities and the hidden states of every rank's tokens and a reduce-scatter of the experts'
    output (again under full recompute); backward a reduce-scatter of the hidden states' and the
    probabilities' gradients and an all-gather of the output's gradient. ``alltoall``: as ZeRO EP."""
    moe_layers = m * shape.layers * layers / spec.layers
    group = lay.tp * lay.ep
    if group == 1:
        return []
    if cfg.megatron.moe_dispatcher == "alltoall":
        tokens_split = lay.cp * (lay.tp if lay.sequence_parallel else 1)
        return [Collective("all-to-all", "ep", lay.ep, dispatch_bytes(cfg, spec, w, tokens_split),
                           int(all_to_all_passes(lay.recompute) * moe_layers), group > g)]
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len / lay.cp * lay.ep  # gathered: every rank's tokens
    hidden, probs, routing = tokens * spec.hidden * w, tokens * shape.experts * w, tokens * shape.experts
    forwards = 2 if lay.recompute == "full" else 1
    inter = group > g
    return [Collective("all-gather", "ep", group, hidden, int(moe_layers * (forwards + 1)), inter),
            Collective("all-gather", "ep", group, probs, int(moe_layers * forwards), inter),
            Collective("all-gather", "ep", group, routing, int(moe_layers * forwards), inter),
            Collective("reduce-scatter", "ep", group, hidden, int(moe_layers * (forwards + 1)), inter),
            Collective("reduce-scatter", "ep", group, probs, int(moe_layers), inter)]
