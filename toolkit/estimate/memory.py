"""Memory per rank of a planned run, before anything is launched.

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

LoRA (``plan.lora``): the frozen base keeps its weights (Φ) and adds the τ trained parameters
(adapters, modules to save); gradients and optimizer rows count τ only, not Φ: the base has none.
QLoRA (``model.quantize``): Q of the base's weights are held in 4 bits, (Φ − Q)·w + Q·0.5 (/D at
stage 3) + Q·c, c the quantization constants per weight (0.0159 B with double quantization, 0.0625 B
without; every rank holds them whole, as the packed storage's quant state).

ZeRO-Offload moves the optimizer (and, at stage 2-3, the fp32 gradient partition) to host memory;
``zero.offload_params`` moves the stage-3 weight partition there too.

Activations (the model; documented, not fitted): for one micro-batch of b sequences of s tokens,
per transformer layer, the tensors autograd keeps, in elements per token, with h hidden, I the MLP
width, a heads and t the TP degree::

    4h                     norm inputs and outputs (replicated across TP ranks; 4h / t with
                           megatron.sequence_parallel, which splits them along the sequence)
    5h / t                 q, k, v after RoPE (K/V heads repeated to all heads: HF's sdpa path and
                           megatron.attention=local both expand GQA), the attention output and
                           its contiguous copy that feeds the output projection; (3h + 2·kv) / t
                           with the toolkit's megatron attention (kv = K/V heads x head dim: not
                           repeated)
    4I / t                 SwiGLU gate, up, act(gate), act(gate)*up   (2I for a plain GELU MLP)
    a·s / t                attention probabilities, only when they are materialized
                           (megatron.attention=local, HF eager); sdpa/flash/flex kernels keep none

times the activation dtype's bytes. Context parallelism (``megatron.cp``) gives each rank s / c of
every row's tokens, so every term is per token of s / c (the attention's all-to-all trades heads
for sequence: ``[s, heads / (t·c)]`` holds as many elements as ``[s / c, heads / t]``), with kv
times ``kv_copies`` where a TP rank's K/V heads are fewer than c; the loss's N is b·s / c, and the
distributed optimizer shards over dp·c. DeepSpeed's Ulysses (``zero.sp``) likewise keeps every one
of these for seq_len / sp tokens per rank (q, k, v after its all-to-all hold all s tokens but heads /
sp of the heads: the same elements), and ZeRO shards over dp x sp ranks (D = dp·sp above); the
logits and loss below count N / sp tokens. With activation checkpointing only each layer's input (h per
token, h / t with sequence parallelism) is kept, plus one layer's full activations while it is
recomputed; ``zero.offload_activations`` moves those kept inputs (layers x b·s/sp·h·w) to host memory
(``host``), where one layer's input at a time comes back for its recompute (inside that layer's full
activations). DeepSpeed runs one micro-batch at a time; Megatron's 1F1B keeps up to pp micro-batches
in flight on the first stage (so its layers x pp, i.e. all layers' worth when pp divides evenly).

Logits and loss (``logits_loss``, part of the activations), N = b·s tokens, V the vocabulary::

    DeepSpeed (HF model, chunked loss ``toolkit.loss.token_loss_sum``):
        2·w·N·V  +  3·4·min(N, r)·V        r = loss_chunk_rows(V): fp32 rows of <= 256 MiB
      the logits in the model's dtype (kept for the loss's backward) and, in the backward, their
      gradient, plus at most three fp32 chunks of rows at once (log-probabilities, their gradient,
      the chunk's gradient before its cast). Never an fp32 [N, V].
    DeepSpeed with ``zero.tiled_loss`` (``toolkit.loss.tiled_token_loss_sum``):
        (w + 3·4)·min(N, r)·V  +  w·N·h  (+ w·V·h when N > r)
      one tile's logits with grad and its three fp32 rows, the hidden states' gradient the
      backward writes tile by tile, and with several tiles one tile's lm_head gradient before it is
      added to the others'; no [N, V] tensor.
    Megatron (vocab-parallel loss, fp32 upcast): 3·4·N·V/t on the last stage
      the fp32 logits, the softmax it saves and their gradient.

A vision-language model (``docs/vlm.md``): the tower and projector are among Φ (the tower's weights held, at
ZeRO-3 partitioned too); a frozen tower (``model.freeze_vision``) is not among τ. Image tokens are tokens of s:
the terms above count them. The tower's own activations per micro-batch, at their bound (every token an image
token: N_v = m²·b·s patches, m² the patches merged into one image token, Qwen2.5-VL 4, LLaVA 1), with h_v, I_v,
L_v the tower's width, MLP width and layers and P = 3·t·p² pixel values per patch::

    pixel values           4·N_v·P                      (fp32, the processor's output)
    tower frozen           + w·N_v·h_v                  the projector's input only
    tower trained          + L_v·N_v·(9h_v + 4I_v)·w     (2I_v without a gated MLP; checkpointed:
                                                         L_v·N_v·h_v·w + one layer's)

``zero.tiled_mlp`` (DeepSpeed's ``TiledMLP``, T = ceil(s / h) tiles): a layer keeps its MLP's input
only (already among the 4h), not the MLP's intermediates; one tile's intermediates, 1/T of a
layer's, live while that tile is recomputed in the backward.

Host memory per rank (``host_load``, ``host_export``): the CPU-side peak of loading the model and of
writing ``hf_final/``, beyond the fixed runtime (Python, libraries), with Λ the largest tensor's
elements (the embedding or LM head V·h, else the widest MLP or attention matrix), S the rank's share
of the weights in the training dtype (S = Φ·w/D at ZeRO-3, Φ·w at ZeRO 0-2, the TP/PP share's
Φ·w on megatron) and O what offload keeps on the host::

    load    O + S + 4·Λ       each rank builds only its share, reading one tensor at a time (at
                             most fp32, as a checkpoint may store it or a random init draws it);
                             ZeRO 0-2 hold one full copy in the training dtype by design
    export  O + S + (w+4)·Λ   the export streams tensor by tensor: one tensor gathered in the
                             training dtype and its fp32 copy for the file, beside the share

These count the weights and the transfer's own transient. On a CPU-only run, where the device is
the host, the optimizer state, gradients and buffers the engine builds come on top in the process's
RSS (the device rows above); on GPUs the share is built on the device, so these bound the host side
from above. No rank ever holds the whole model at ZeRO-3 or TP/PP. On a CPU-only run the libraries
add one more tensor in the training dtype to ``load`` (w·Λ), one at a time: DeepSpeed's ``zero.Init``
receives each parameter whole from rank 0 before partitioning it (ranks >= 1), and megatron without
CUDA casts a full-size fp32 master of each weight before keeping its slice. On GPUs both are device
memory. ``benchmarks/big_models.py`` measures all of this against these formulas.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from toolkit.config import ConfigError, RunConfig
from toolkit.estimate.moe import dispatch_bytes, moe_shape, zero_ep
from toolkit.layout import Layout, divisors, kv_copies, stage_layers
from toolkit.plan.checks import check_layout
from toolkit.plan.model import ModelSpec

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
USABLE = 0.92  # of device memory: the rest goes to the CUDA context, NCCL buffers and fragmentation


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
    logits_loss: float = 0.0
    """Of ``activations``: the logits and the loss's own memory (the docstring's formulas)."""
    host_load: float = 0.0
    """Host memory of loading the model, per rank (the docstring's formulas)."""
    host_export: float = 0.0
    """Host memory of writing ``hf_final/``, per rank."""
    largest_tensor: int = 0
    """Elements of the model's largest tensor (Λ)."""

    @property
    def model_state(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.model_state + self.buffers + self.activations


def memory(cfg: RunConfig, spec: ModelSpec, lay: Layout, bucket: int | None = None,
           lora_trainable: int | None = None, ep: int | None = None) -> Memory:
    """Per-rank memory of the fullest rank; the formulas are in this module's docstring.

    ``bucket``: DeepSpeed's zero_optimization.reduce_bucket_size (elements) from the resolved JSON;
    default hidden^2, what "auto" resolves to. ``lora_trainable``: a LoRA run's trained parameters
    (``plan.lora.trainable``), None for full fine-tuning. ``ep``: DeepSpeed's expert parallelism
    (default ``zero.ep``; ``estimate/moe.py``)."""
    w = DTYPE_BYTES[cfg.model.dtype]
    if lay.backend == "deepspeed":
        mem = _deepspeed_memory(cfg, spec, lay, w, bucket or spec.hidden ** 2, lora_trainable)
        ep = zero_ep(cfg) if ep is None else ep
        return mem if ep == 1 or lora_trainable is not None else _with_zero_ep(cfg, spec, lay, w, mem, ep)
    return max((_megatron_stage_memory(cfg, spec, lay, w, i, lora_trainable) for i in range(lay.pp)),
               key=lambda m: m.total)


def _deepspeed_memory(cfg: RunConfig, spec: ModelSpec, lay: Layout, w: int, bucket: int,
                      lora_trainable: int | None = None) -> Memory:
    d, stage = lay.dp * lay.sp, lay.zero_stage  # ZeRO partitions over the whole dp x sp world
    # what trains (gradients, optimizer): a vision-language model's frozen tower does not (docs/vlm.md)
    frozen = spec.vision if cfg.model.freeze_vision else spec.vision_unused
    tau = spec.total - frozen if lora_trainable is None else lora_trainable
    phi = spec.total if lora_trainable is None else spec.total + lora_trainable  # what is held
    weights = _held_weights(cfg, spec, phi, w, d if stage == 3 else 1)
    # Measured (tests/e2e/test_estimate.py): DeepSpeed's ZeRO-1 also reduces each bucket into this
    # rank's partition as backward goes, so after any backward only the partition is left.
    grads = tau * w / (d if stage >= 1 else 1)
    master = 4 if (w != 4 or stage >= 1) else 0  # ZeRO 1-3 keep an fp32 partition even of fp32 weights
    optim = (8 + master) * tau / (d if stage >= 1 else 1)
    # ZeRO 1-3 reduce gradients through a reduce_bucket_size bucket (2 GB in fp32 at DeepSpeed's
    # 5e8 default: it matters); stage 3 also gathers the current and the prefetched layer.
    buffers = 0 if stage == 0 else bucket * w + (2 * max(spec.per_layer, default=0) * w if stage == 3 else 0)
    host = 0.0
    if lay.offload_optimizer:
        host += optim + (grads if stage >= 2 else 0)
        optim, grads = 0.0, (0.0 if stage >= 2 else grads)
    if lay.offload_params and stage == 3:
        host += weights
        weights = 0.0
    loss = (tiled_loss_bytes if cfg.zero.tiled_loss else chunked_loss_bytes)(cfg, spec, w, lay.sp)
    tiles = mlp_tile_count(cfg, spec, lay.sp) if cfg.zero.tiled_mlp else 1
    acts = {r: _activations(cfg, spec, list(range(spec.layers)), 1, 1, r, w, materialized=False, seq_split=lay.sp,
                            mlp_tiles=tiles) + loss + tower_activations(cfg, spec, w, r) for r in ("none", "full")}
    offloaded = offloaded_inputs(cfg, spec, lay, w)
    acts["full"] -= offloaded
    share = _held_weights(cfg, spec, phi, w, d if stage == 3 else 1)
    on_host = host + (0.0 if lay.offload_params and stage == 3 else share)  # offloaded weights: in host already
    largest = largest_tensor(spec)
    return Memory(weights, grads, optim, buffers, acts[lay.recompute if lay.recompute in acts else "none"],
                  acts["none"], acts["full"], host + (offloaded if lay.recompute == "full" else 0.0), phi, logits_loss=loss,
                  host_load=on_host + 4 * largest, host_export=on_host + (w + 4) * largest, largest_tensor=largest)


def _with_zero_ep(cfg: RunConfig, spec: ModelSpec, lay: Layout, w: int, mem: Memory, ep: int) -> Memory:
    """``mem`` (ZeRO without expert parallelism) with the routed experts split over ``ep`` ranks
    (``estimate/moe.py``): below stage 3 each rank holds Φ_x / ep of the experts' weights (stage 0 also
    their gradients and optimizer state); at stages 1-3 an expert's gradients and optimizer state are
    sharded over the d / ep ranks holding it (Φ_x / d each: unchanged); stage 3 gathers E / ep of a
    layer's experts. Plus the dispatched token rows kept for the backward, ``2·T·k·h·w`` per MoE layer
    (one layer's under activation checkpointing)."""
    shape = moe_shape(spec)
    if shape is None:
        return mem
    gone = shape.params * (1 - 1 / ep)  # experts this rank no longer holds
    master = 4 if (w != 4 or lay.zero_stage >= 1) else 0
    weights, grads, optim, buffers = mem.weights, mem.gradients, mem.optimizer, mem.buffers
    if lay.zero_stage < 3:
        weights -= gone * w
    else:
        buffers -= 2 * shape.largest_layer * (1 - 1 / ep) * w
    if lay.zero_stage == 0:
        grads -= gone * w
        optim -= (8 + master) * gone
    dispatched = 2 * dispatch_bytes(cfg, spec, w, lay.sp)
    kept = {"none": dispatched * shape.layers, "full": dispatched}
    return replace(mem, weights=weights, gradients=grads, optimizer=optim, buffers=buffers,
                   activations=mem.activations + kept["full" if lay.recompute == "full" else "none"],
                   activations_no_ckpt=mem.activations_no_ckpt + kept["none"],
                   activations_ckpt=mem.activations_ckpt + kept["full"], params=int(mem.params - gone))


def _held_weights(cfg: RunConfig, spec: ModelSpec, phi: int, w: int, shards: int) -> float:
    """Bytes of ``phi`` weights in dtype bytes ``w`` over ``shards`` partitions; a 4-bit base's
    ``spec.quantized`` packed (and partitioned) at half a byte, their constants whole on every rank."""
    if cfg.model.quantize == "none":
        return phi * w / shards
    from toolkit.lora.quant import stored_bytes_per_weight
    packed, constants = stored_bytes_per_weight(cfg)
    q = spec.quantized
    return ((phi - q) * w + q * packed) / shards + q * constants


def offloaded_inputs(cfg: RunConfig, spec: ModelSpec, lay: Layout, w: int) -> float:
    """``zero.offload_activations``: the checkpointed layers' inputs kept on the host, layers x b·s/sp·h·w
    (one comes back to the device for its layer's recompute, inside that layer's full activations)."""
    if not lay.offload_activations:
        return 0.0
    return spec.layers * cfg.train.micro_batch_size * cfg.data.seq_len / lay.sp * spec.hidden * w


def _megatron_stage_memory(cfg: RunConfig, spec: ModelSpec, lay: Layout, w: int, stage: int,
                           lora_trainable: int | None = None) -> Memory:
    t, stages = lay.tp, stage_layers(spec.layers, lay)
    layers = stages[stage]
    vocab = lay.padded_vocab
    first, last = stage == 0, stage == lay.pp - 1
    experts = [spec.per_layer_experts[i] if spec.per_layer_experts else 0 for i in layers]
    phi = sum((spec.per_layer_matrices[i] - e) / t + spec.per_layer[i] - spec.per_layer_matrices[i]
              for i, e in zip(layers, experts))
    phi += vocab * spec.hidden / t * (first + (last and (not spec.tied or lay.pp > 1)))
    phi += spec.other if last else 0
    expert_phi = sum(experts) / (t * lay.ep)  # expert tensor parallelism = tp
    # the distributed optimizer shards dense state over dp x cp, experts' over the dp x cp / ep expert replicas
    shards = lay.dp * lay.cp
    optim = (8 + (4 if w != 4 else 0)) * (phi / shards + expert_phi / (shards // lay.ep))
    phi += expert_phi
    if lora_trainable is not None:  # only the adapters train: the stage's share of them, counted whole
        tau = lora_trainable * len(layers) / spec.layers  # on each TP rank (an upper bound: about half
        adam = (8 + (4 if w != 4 else 0)) * tau / shards  # of each adapter is TP-split)
        return _megatron_memory(cfg, spec, lay, w, stage, layers, phi + tau, tau, adam)
    return _megatron_memory(cfg, spec, lay, w, stage, layers, phi, phi, optim)


def _megatron_memory(cfg: RunConfig, spec: ModelSpec, lay: Layout, w: int, stage: int, layers: list[int],
                     phi: float, trained: float, optim: float) -> Memory:
    """A stage's memory of ``phi`` weights of which ``trained`` get fp32 gradients, ``optim`` bytes
    of optimizer state."""
    t, last = lay.tp, stage == lay.pp - 1
    in_flight = min(lay.pp - stage, micro_batches(cfg, lay))
    sp = lay.sequence_parallel and t > 1
    local = cfg.megatron.attention == "local"  # megatron's DotProductAttention: scores kept, K/V repeated
    loss = _vocab_parallel_loss_bytes(cfg, spec, t) / lay.cp if last else 0.0
    acts = {r: _activations(cfg, spec, layers, t, in_flight, r, w, materialized=local, sp=sp, kv_repeated=local,
                            cp=lay.cp) + loss
            for r in ("none", "selective", "full")}
    largest = largest_tensor(spec)
    return Memory(phi * w, trained * 4, optim, 0.0, acts[lay.recompute], acts["none"], acts["full"], 0.0, int(phi),
                  logits_loss=loss,
                  host_load=phi * w + 4 * largest, host_export=phi * w + (w + 4) * largest, largest_tensor=largest)


def micro_batches(cfg: RunConfig, lay: Layout) -> int:
    """Micro-batches per rank per step at ``lay.dp`` (at least one: the scaling table grows dp)."""
    return max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * lay.dp))


def _activations(cfg: RunConfig, spec: ModelSpec, layers: list[int], t: int, in_flight: int, recompute: str,
                 w: int, materialized: bool, sp: bool = False, kv_repeated: bool = True, cp: int = 1,
                 seq_split: int = 1, mlp_tiles: int = 1) -> float:
    """Bytes autograd keeps for ``in_flight`` micro-batches on these layers (see the module docstring);
    ``sp``: sequence parallelism splits the norms' tensors and the layer inputs over the t TP ranks;
    ``kv_repeated``: K and V are kept at every query head's width (GQA expanded); ``cp``: context
    parallelism, each rank holding s / cp of every row; ``seq_split``: each rank holds seq_len /
    seq_split tokens of every row (DeepSpeed's Ulysses, ``zero.sp``); ``mlp_tiles`` > 1: the MLP
    through TiledMLP (its intermediates kept for one tile at a time, during its recompute)."""
    b, s = cfg.train.micro_batch_size, cfg.data.seq_len // seq_split
    h, mlp = spec.hidden, spec.mlp_width
    split = t if sp else 1
    tokens = b * s / cp
    scores = spec.heads * s / t if materialized and recompute != "selective" else 0
    kv = h if kv_repeated else spec.kv_width * (kv_copies(spec.kv_heads // t, cp) if spec.kv_heads % t == 0 else 1)
    attention = (3 * h + 2 * kv) / t
    intermediates = (4 if spec.glu else 2) * mlp / t
    tiled = mlp_tiles > 1  # TiledMLP keeps only its input (among the 4h); a tile's intermediates in backward
    per_token = 4 * h / split + attention + (0 if tiled else intermediates) + scores
    layer = per_token * tokens * w
    kept = len(layers) * (tokens * h / split * w if recompute == "full" else layer) * in_flight
    recomputing = layer if recompute == "full" else 0  # one layer's full activations during its backward
    return kept + recomputing + (intermediates * tokens / mlp_tiles * w if tiled else 0)


def tower_activations(cfg: RunConfig, spec: ModelSpec, w: int, recompute: str) -> float:
    """A vision-language model's tower per micro-batch (the docstring's formulas), at its bound: every token of
    the b·s an image token, N_v = m²·b·s patches; 0 for a text model."""
    if spec.tower is None:
        return 0.0
    v = spec.tower
    patches = v["patches_per_token"] * cfg.train.micro_batch_size * cfg.data.seq_len
    pixels = 4 * patches * v["patch_inputs"]
    if cfg.model.freeze_vision:  # no grad through the tower: the projector's input only
        return pixels + patches * v["hidden"] * w
    per_patch = 9 * v["hidden"] + (4 if v["glu"] else 2) * v["mlp"]
    layer = patches * per_patch * w
    kept = v["layers"] * (patches * v["hidden"] * w if recompute == "full" else layer)
    return pixels + kept + (layer if recompute == "full" else 0)


def mlp_tile_count(cfg: RunConfig, spec: ModelSpec, seq_split: int = 1) -> int:
    """``zero.tiled_mlp``'s tiles for a rank's rows (``toolkit.loss.mlp_tiles``: ALST's rule)."""
    from toolkit.loss import mlp_tiles
    return mlp_tiles(cfg.data.seq_len // seq_split, spec.hidden)


def chunked_loss_bytes(cfg: RunConfig, spec: ModelSpec, w: int, seq_split: int = 1) -> float:
    """The HF path's logits and chunked loss: 2·w·N·V + 3·4·min(N, r)·V (module docstring), N the
    rank's tokens (seq_len / seq_split of each row with ``zero.sp``)."""
    from toolkit.loss import loss_chunk_rows
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // seq_split
    return 2 * w * tokens * spec.vocab + 3 * 4 * min(tokens, loss_chunk_rows(spec.vocab)) * spec.vocab


def tiled_loss_bytes(cfg: RunConfig, spec: ModelSpec, w: int, seq_split: int = 1) -> float:
    """``zero.tiled_loss``: (w + 3·4)·min(N, r)·V + w·N·h (+ w·V·h when N > r; module docstring)."""
    from toolkit.loss import loss_chunk_rows
    tokens, rows = cfg.train.micro_batch_size * cfg.data.seq_len // seq_split, loss_chunk_rows(spec.vocab)
    tile_head_grad = w * spec.vocab * spec.hidden if tokens > rows else 0
    return (w + 3 * 4) * min(tokens, rows) * spec.vocab + w * tokens * spec.hidden + tile_head_grad


def _vocab_parallel_loss_bytes(cfg: RunConfig, spec: ModelSpec, t: int) -> float:
    """Megatron's loss on the last stage: fp32 logits, softmax and gradient, 3·4·N·V/t."""
    return 3 * 4 * cfg.train.micro_batch_size * cfg.data.seq_len * spec.vocab / t


def largest_tensor(spec: ModelSpec) -> int:
    """Elements of the largest tensor a loader or an export holds at once (Λ): the embedding or LM
    head [V, h], else the widest MLP matrix [I, h] or attention projection [heads·head_dim, h]
    (a checkpoint stores experts one tensor each, so an expert counts as one MLP matrix)."""
    return max(spec.vocab, spec.mlp_width, spec.heads * spec.head_dim) * spec.hidden


# --- fit and suggestions ----------------------------------------------------------------------------

def fits(mem: Memory, device_gib: float) -> bool:
    return mem.total <= USABLE * device_gib * GiB


def candidate_layouts(cfg: RunConfig, spec: ModelSpec, world: int) -> list[Layout]:
    """Every valid layout of this backend at this world size, least sharding / recompute first:
    the run config varied and put through the one layout check (``check_layout``)."""
    out: list[Layout] = []
    for variant in _variants(cfg, world):
        try:
            out.append(check_layout(variant, spec, world))
        except ConfigError:
            continue
    return out


def _variants(cfg: RunConfig, world: int):
    def changed(section: str, **fields) -> RunConfig:
        return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=fields)})
    if cfg.backend == "deepspeed":
        for ckpt in (False, True):
            base = changed("model", activation_checkpointing=ckpt)
            zero = [dict(stage=s) for s in (0, 1, 2, 3)] + [dict(stage=s, offload_optimizer=True) for s in (2, 3)] + \
                [dict(stage=3, offload_optimizer=True, offload_params=True)]
            for z in zero:  # activations offloaded as set, where they are checkpointed
                yield base.model_copy(update={"zero": base.zero.model_copy(update={
                    "offload_optimizer": False, "offload_params": False,
                    "offload_activations": cfg.zero.offload_activations and ckpt, **z})})
        return
    for recompute in ("none", "selective", "full"):
        for mp in sorted({tp * pp for tp in divisors(world) for pp in divisors(world // tp)}):
            for tp in divisors(mp):
                ep = cfg.megatron.ep if (world // mp) % cfg.megatron.ep == 0 else 1
                yield changed("megatron", tp=tp, pp=mp // tp, recompute=recompute, ep=ep, vpp=None,
                              first_stage_layers=None, last_stage_layers=None,
                              sequence_parallel=cfg.megatron.sequence_parallel and tp > 1)


def suggestions(cfg: RunConfig, spec: ModelSpec, world: int, device_gib: float, bucket: int | None = None,
                limit: int = 3, lora_trainable: int | None = None) -> list[tuple[Layout, Memory]]:
    found = []
    for lay in candidate_layouts(cfg, spec, world):
        mem = memory(cfg, spec, lay, bucket, lora_trainable)
        if fits(mem, device_gib):
            found.append((lay, mem))
        if len(found) == limit:
            break
    return found
