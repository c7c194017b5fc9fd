"""The parallel layout, on the ground floor: ``Layout`` (every parallel size, each rank's place, the
padded vocabulary with its divisor) is the one object the engines, the estimator, the checkpoint
writers, the resume's reshard and the converter are given, and the rules every one of them shares
(divisors, valid sizes, megatron's vocabulary padding, stage splits) have their one home here.

Choosing and checking a run's layout against its config and model is the plan's
(``toolkit/plan/checks.py``). No torch import here: the converter's torch-free route uses it too.
"""
from __future__ import annotations

import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from toolkit.config import MegatronConfig

DEFAULT_VOCAB_DIVISOR = MegatronConfig.model_fields["make_vocab_size_divisible_by"].default
"""megatron's own default (128): the converter's when neither the source nor ``--vocab-divisor`` names one."""



class Layout(BaseModel):
    """How a run's ranks split the work. ``dp`` x ``tp`` x ``pp`` x ``cp`` x ``sp`` = ``world`` (``cp``:
    megatron only, ``sp``: DeepSpeed only); megatron carves the ``ep`` expert-parallel ranks out of each
    DP group (with its CP ranks); on DeepSpeed (``zero.ep``, AutoEP) ep consecutive ranks of the dp share
    each layer's experts."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["deepspeed", "megatron"]
    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    cp: int = 1
    """megatron.cp: ranks that split each sequence (the same samples, 1 / cp of every row each)."""
    sp: int = 1
    """DeepSpeed's Ulysses sequence-parallel size (``zero.sp``): consecutive ranks share each row."""
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_activations: bool = False
    """zero.offload_activations: the checkpointed layers' inputs kept in host memory."""
    recompute: Literal["none", "selective", "full"] = "none"
    """megatron.recompute; on DeepSpeed ``full`` is HF's activation checkpointing."""
    micro_batches: int = 1
    """Micro-batches per rank per optimizer step (gradient accumulation)."""
    padded_vocab: int = 0
    """Megatron's embedding rows (vocab padded to a multiple of make_vocab_size_divisible_by x tp)."""
    vocab_divisor: int = DEFAULT_VOCAB_DIVISOR
    """megatron.make_vocab_size_divisible_by: what a checkpoint written for this run (the reshard on
    resume converts one) pads the vocabulary with."""

    @classmethod
    def of_sizes(cls, backend: Literal["deepspeed", "megatron"], *, dp: int, tp: int = 1, pp: int = 1, ep: int = 1,
                 zero_stage: int = 0, vocab_divisor: int = DEFAULT_VOCAB_DIVISOR) -> Layout:
        """A checkpoint's layout given by its sizes (the converter's ``--tp/--pp/--dp/--ep``): what a
        writer needs; the padded vocabulary follows from a model's vocabulary (``padded``)."""
        return cls(backend=backend, world=dp * tp * pp, dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=zero_stage,
                   vocab_divisor=vocab_divisor)

    def padded(self, vocab: int) -> int:
        """Megatron's embedding rows for a ``vocab``-token vocabulary at this layout (``padded_vocab_size``)."""
        return padded_vocab_size(vocab, self.vocab_divisor, self.tp)

    def with_vocab(self, vocab: int) -> Layout:
        """This layout with ``padded_vocab`` set for a ``vocab``-token model."""
        return self.model_copy(update={"padded_vocab": self.padded(vocab)})

    def for_checkpoint(self) -> Layout:
        """The layout a checkpoint converted for this run is written at (a resume's reshard): its sizes
        as the converter takes them (ZeRO: one partition per rank of dp x sp, stage 2 for a stage-0 run,
        whose engine loads any universal checkpoint) and its vocabulary divisor."""
        if self.backend == "deepspeed":  # (zero.ep: AutoEP's names and per-expert files, ``formats/zero.py``)
            return Layout.of_sizes("deepspeed", dp=self.zero_partitions, zero_stage=self.zero_stage or 2, ep=self.ep)
        return Layout.of_sizes("megatron", dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep,
                               vocab_divisor=self.vocab_divisor)

    @property
    def zero_partitions(self) -> int:
        """ZeRO's partitions: one per rank of dp x sp (the Ulysses ranks of a row hold one each)."""
        return zero_partitions(self.record())

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel replica: tp x pp x cp on megatron, sp on DeepSpeed."""
        return self.tp * self.pp * self.cp * self.sp

    def fits(self, world: int) -> bool:
        return world % self.model_parallel == 0

    def at_world(self, world: int) -> Layout:
        """This split on ``world`` ranks (``fits``): the same model-parallel sizes, dp = world / them."""
        if not self.fits(world):
            raise ValueError(f"{world} ranks do not divide into replicas of {self.model_parallel} ({self.describe()})")
        return self.model_copy(update={"world": world, "dp": world // self.model_parallel})

    def place(self, rank: int) -> Place:
        """Where global ``rank`` sits. megatron-core orders its ranks tp, cp, dp, pp (fastest first:
        ``initialize_model_parallel``'s default order; expert ranks are carved out of each cp x dp
        block); DeepSpeed's Ulysses ranks of a row are consecutive (sp, then dp)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside this layout's world of {self.world}")
        if self.backend == "deepspeed":
            return Place(dp=rank // self.sp, sp=rank % self.sp)
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        return Place(tp=tp, cp=cp, dp=rest % self.dp, pp=rest // self.dp)

    def describe(self) -> str:
        if self.backend == "deepspeed":
            off = "+offload_opt" if self.offload_optimizer else ""
            off += "+offload_params" if self.offload_params else ""
            off += "+offload_activations" if self.offload_activations else ""
            return f"ZeRO-{self.zero_stage}{off} dp={self.dp}" + (f" sp={self.sp}" if self.sp > 1 else "") + \
                (f" ep={self.ep}" if self.ep > 1 else "") + f" ckpt={self.recompute}"
        return f"tp={self.tp} pp={self.pp} dp={self.dp}" + (f" ep={self.ep}" if self.ep > 1 else "") + \
            (f" cp={self.cp}" if self.cp > 1 else "") + f" recompute={self.recompute}"

    def record(self) -> dict:
        """What a checkpoint's meta.json records of the layout that wrote it (and resume compares)."""
        # cp / sp only where > 1: records of runs without them stay as they were (an equal record resumes
        # "as saved")
        if self.backend == "deepspeed":  # ZeRO's files: one per rank of dp x sp (``zero_partitions``)
            return {"dp": self.dp, "tp": 1, "pp": 1, "zero_stage": self.zero_stage} | \
                ({"sp": self.sp} if self.sp > 1 else {}) | ({"ep": self.ep} if self.ep > 1 else {})
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "format": "torch_dist",
                **({"cp": self.cp} if self.cp > 1 else {})}


class Place(NamedTuple):
    """One rank's coordinate along each parallel dimension of a ``Layout``."""
    dp: int = 0
    tp: int = 0
    pp: int = 0
    cp: int = 0
    sp: int = 0


def zero_partitions(record: dict) -> int:
    """How many ranks' files a DeepSpeed checkpoint of this layout record holds: ZeRO partitions over
    the whole world, dp x sp (the Ulysses ranks of a row hold a partition each, like DP ranks)."""
    return record["dp"] * record.get("sp", 1)



def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp(heads: int, kv_heads: int) -> list[int]:
    """TP sizes that split both the query heads and the KV heads (megatron's num_query_groups)."""
    return [t for t in divisors(kv_heads) if heads % t == 0]


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: the next multiple of ``divisible_by * tp`` (the one home of this rule)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)



def valid_sp(heads: int, kv_heads: int) -> list[int]:
    """Ulysses sizes for these head counts: each rank gets heads / sp query heads and kv_heads / sp KV
    heads, or (sp a multiple of kv_heads) one KV head, which DeepSpeed's all-to-all replicates."""
    return [s for s in divisors(heads) if kv_heads % s == 0 or s % kv_heads == 0]



RUN_FIELDS = {"tp": "megatron.tp", "pp": "megatron.pp", "vpp": "megatron.vpp", "ep": "megatron.ep"}


def megatron_split_problems(heads: int, kv_heads: int, layers: int, experts: int, tp: int, pp: int, ep: int,
                            uneven: bool = False, vpp: int | None = None, world: int | None = None,
                            model: str = "this model", names: dict = RUN_FIELDS) -> list[str]:
    """How a model splits over tp / pp / ep, each problem with the valid choices (a run's megatron.*
    fields and the converter's ``--tp/--pp/--ep``, named by ``names``, are checked alike)."""
    problems = []
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value % tp:
            valid = valid_tp(heads, kv_heads)
            problems.append(f"{name}={value} is not divisible by {names['tp']}={tp}; choose tp in {valid}")
            break
    chunks = pp * (vpp or 1)
    if not uneven and layers % chunks:
        valid = [p for p in divisors(layers) if layers % (p * (vpp or 1)) == 0 and (world is None or world % (p * tp) == 0)]
        problems.append(f"num_hidden_layers={layers} is not divisible by {names['pp']}={pp} x {names['vpp']}={vpp or 1} "
                        f"(= {chunks} model chunks); choose pp in {valid}"
                        + (" or a vpp that divides layers / pp" if vpp else
                           ", or split unevenly with megatron.first_stage_layers / last_stage_layers"))
    if vpp and pp < 2:
        problems.append(f"{names['vpp']}={vpp} needs {names['pp']} >= 2 (got pp={pp}); unset vpp or raise pp")
    if ep > 1 and not experts:
        problems.append(f"{names['ep']}={ep} needs a mixture-of-experts model; {model} has no experts "
                        f"(unset {names['ep']})")
    if experts and experts % ep:
        problems.append(f"{experts} experts do not divide over {names['ep']}={ep}; choose ep in {divisors(experts)}")
    return problems



def valid_cp(heads: int, tp: int, seq_len: int, sequence_parallel: bool = False) -> list[int]:
    """Context-parallel sizes for ``heads`` query heads at ``tp``: the all-to-all splits each TP
    rank's heads over cp (its KV heads too, replicated where fewer), and every row into 2 x cp
    chunks (of whole TP slices under sequence parallelism)."""
    rows = 2 * (tp if sequence_parallel else 1)
    return [c for c in divisors(heads // tp) if seq_len % (rows * c) == 0] if heads % tp == 0 else []


def kv_copies(kv_heads_per_tp: int, cp: int) -> int:
    """How many times the context-parallel all-to-all repeats each KV head of a TP rank: enough
    that they divide over cp (``lcm(kv, cp) / kv``); 1 where they already do."""
    return cp // math.gcd(kv_heads_per_tp, cp)



def stage_layers(layers: int, lay: Layout) -> list[list[int]]:
    """Global layer indices on each pipeline stage (even split, or the uneven first/last counts)."""
    first, last, pp = lay.first_stage_layers, lay.last_stage_layers, lay.pp
    if pp == 1:
        return [list(range(layers))]
    counts = [None] * pp
    counts[0], counts[-1] = first, last
    rest = layers - sum(c for c in counts if c is not None)
    free = sum(c is None for c in counts)
    counts = [c if c is not None else rest // free for c in counts]
    starts = [sum(counts[:i]) for i in range(pp)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]
