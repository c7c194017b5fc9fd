"""Typed run configuration: YAML file + ``--set key=value`` overrides, validated once.

``toolkit.plan`` resolves it with the presets and the world size into the run plan, which every
rank reads (``RUN_DIR/plan.json``), so all ranks run exactly the same settings. Errors name the key,
the value, the constraint and the fix; unknown keys suggest the nearest valid one.
"""
from __future__ import annotations

import difflib
import os
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from toolkit.config_input import ConfigError, explain, parse_yaml, read_yaml_file  # ConfigError: imported from here

DEMO_DIR = Path(str(files("toolkit") / "demo"))
"""The embedded demo (tiny Llama config, corpus): package data, found as the package finds it."""


DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""model.dtype (and the converter's --dtype) -> the torch dtype's name."""
PREFERENCE_OBJECTIVES = ("dpo", "orpo")
"""The ``train.objective`` values that train on ``data.template: preference`` pairs (and only they do)."""


class _Section(BaseModel):
    # strict: no coercion between kinds (``true`` is not 1, ``2.0`` is not 2, ``"3"`` is not 3); an
    # integer is a number where a float is asked. No inf or nan anywhere.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _paths_as_text(cls, value):
        return os.fspath(value) if isinstance(value, os.PathLike) else value  # the Python API's pathlib paths


class ModelConfig(_Section):
    name_or_path: str = str(DEMO_DIR / "tiny-llama")
    """An HF model directory or config.json, as ``from_pretrained`` takes it."""
    init: Literal["pretrained", "random"] = "random"
    """``pretrained`` loads weights from name_or_path; ``random`` builds from its config with train.seed."""
    tokenizer: str | None = None
    """Tokenizer directory; default: name_or_path, or the demo's BPE trained offline when absent."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training precision. bf16/fp16: weights and activations in that dtype, fp32 master weights and
    optimizer state; fp16 uses dynamic loss scaling (skipped steps are counted in metrics.jsonl)."""
    tf32: bool = True
    """On NVIDIA GPUs, fp32 matmuls run on tensor cores in TF32 (as PyTorch Lightning and HF Trainer
    offer); false keeps strict IEEE fp32. MFU uses the matching peak."""
    activation_checkpointing: bool = False
    quantize: Literal["none", "nf4", "fp4"] = "none"
    """A 4-bit base under LoRA adapters (QLoRA, DeepSpeed, bitsandbytes: ``toolkit/lora/quant.py``, docs/lora.md)."""
    quantize_double: bool = True
    """With model.quantize: quantize the quantization constants too (bitsandbytes' double quantization)."""
    freeze_vision: bool = True
    """A vision-language model (``docs/vlm.md``): its vision tower stays frozen, the projector and the language
    model train; false trains the tower too."""
    experts_implementation: Literal["auto", "eager", "grouped_mm"] = "auto"
    """Mixture-of-experts models: how the routed experts compute (transformers' own name and values).
    ``grouped_mm``: one ``torch._grouped_mm`` per projection over all experts' tokens; ``eager``: a loop
    over the experts; ``auto``: transformers' choice on the DeepSpeed path (grouped_mm in transformers 5),
    on megatron grouped where a one-time probe of ``torch._grouped_mm`` runs in the run's dtype and device.
    Which one ran is recorded in metrics.jsonl (``event: experts``). docs/moe.md."""
    trust_remote_code: bool = False
    """Let transformers import and run the Python files of a model (or tokenizer) directory whose
    config.json names custom classes (``auto_map``). Off: such a directory is refused before anything
    of it is imported, whatever stdin holds; a model transformers implements itself never needs it."""


class DataConfig(_Section):
    path: str = str(DEMO_DIR / "corpus.txt")
    """Local text/json/jsonl/csv/parquet file(s) (comma-separated or glob), a ``save_to_disk``
    directory, or a hub dataset name when online."""
    format: Literal["auto", "text", "json", "csv", "parquet", "disk", "hub", "megatron"] = "auto"
    """``megatron``: ``path`` names Megatron indexed datasets (PREFIX.bin + PREFIX.idx; ``auto`` detects them)."""
    weights: list[float] | None = None
    """One per comma-separated ``path`` part: a blend of sources, normalized (``toolkit/data/blend.py``)."""
    streaming: bool = False
    """Read, tokenize and pack ``path`` as the run trains, never whole (``toolkit/data/stream.py``)."""
    split: str = "train"
    text_column: str = "text"
    template: Literal["none", "instruction", "chat", "preference"] = "none"
    """``instruction``: prompt/response columns; ``chat``: a messages column; ``preference``: prompt,
    chosen and rejected columns (text, or TRL's conversational message lists), each pair packed as two
    documents of one row (``toolkit/data/templates.py``). Prompt tokens get no loss."""
    prompt_column: str = "prompt"
    response_column: str = "response"
    messages_column: str = "messages"
    images_column: str = "images"
    """A vision-language model's ``chat`` rows: the images of the row's ``{"type": "image"}`` parts, in order
    (paths relative to the data file, or bytes; ``docs/vlm.md``)."""
    chosen_column: str = "chosen"
    """``preference``: the preferred answer (text, or a list of assistant messages)."""
    rejected_column: str = "rejected"
    """``preference``: the dispreferred answer, in the same form as ``chosen_column``."""
    seq_len: int = Field(128, ge=2, description="tokens per row; a row predicts seq_len - 1 of them at least")
    packing: Literal["concat", "documents", "pad"] | None = None
    """How documents become rows of ``seq_len`` tokens (``toolkit/data/pack.py``). ``concat``: one token
    stream cut into rows, attention and positions run across documents (pretraining style).
    ``documents``: whole documents packed into rows, each attending only to itself with positions
    restarting at 0 (every document's result equals running it alone). ``pad``: one document per
    row, padded (the reference ``documents`` must match). Default (None): ``documents`` for
    ``template`` instruction/chat/preference, ``concat`` for ``none``; read it as ``packing_mode``.
    ``preference`` rows hold whole pairs (``pad``: one pair per row); ``concat`` is refused there."""
    overflow: Literal["split", "drop"] = "split"
    """``documents``/``pad``: a document longer than ``seq_len`` is cut into ``seq_len`` pieces (each
    its own document) or dropped; the count is logged and kept in the run's data summary. Template
    ``preference``: ``drop`` (its default and only choice: a pair longer than ``seq_len`` is dropped)."""
    eval_fraction: float = 0.05
    num_proc: int = Field(1, ge=1, description="processes that tokenize; 1 tokenizes in the launcher")
    cache_dir: str | None = None
    """Where tokenized/packed data is cached; default: ``cache_root()/data``, ``~/.cache/toolkit/data`` unless
    ``TOOLKIT_CACHE_DIR`` or ``XDG_CACHE_HOME`` says otherwise (``toolkit/storage/cache.py``)."""

    @model_validator(mode="after")
    def _preference_layout(self) -> "DataConfig":
        if self.template != "preference":
            return self
        if self.packing == "concat":
            raise ValueError("data.packing='concat' cannot hold preference pairs (it cuts one token stream "
                             "across documents, so a pair's answers would be split and see each other); use "
                             "data.packing=documents (several whole pairs per row, the default) or pad (one pair per row)")
        if self.overflow == "split":
            if "overflow" in self.model_fields_set:
                raise ValueError("data.overflow='split' cannot cut a preference pair (a piece would lose its "
                                 "prompt or its answer); use data.overflow=drop (the default for "
                                 "data.template=preference: pairs longer than data.seq_len are dropped and "
                                 "counted) or raise data.seq_len")
            self.overflow = "drop"  # the default for pairs; the guard above keeps re-validation from looping
        return self

    @property
    def packing_mode(self) -> str:
        """``packing``, or its default for ``template``."""
        return self.packing or ("concat" if self.template == "none" else "documents")

    @field_validator("eval_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 <= v < 0.5:
            raise ValueError(f"data.eval_fraction={v} must be in [0, 0.5)")
        return v


class TrainConfig(_Section):
    steps: int = Field(300, ge=1, description="optimizer steps")
    seed: int = Field(1234, ge=0, lt=2**63, description="seeds the model init and the data order")
    global_batch_size: int = Field(16, ge=1, description="samples per optimizer step")
    micro_batch_size: int = Field(4, ge=1, description="samples per forward of a rank")
    lr: float = Field(3e-3, ge=0, description="the peak learning rate; 0 holds the weights fixed, a negative one "
                                              "would climb the loss")
    min_lr: float | None = Field(None, ge=0, description="the learning rate the schedule decays to; "
                                                        "default: lr / 10")
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(20, ge=0, description="steps of linear warmup to lr; 0: none")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled decay; 0: none")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="AdamW's second-moment decay")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's denominator term")
    grad_clip: float = Field(1.0, ge=0, description="the global gradient norm is clipped to it; 0: no clipping")
    eval_every: int = Field(50, ge=0, description="steps between evals; 0: never")
    eval_batches: int = Field(4, ge=1, description="micro-batches per rank in an eval")
    log_every: int = Field(10, ge=1, description="steps between console lines; 1: every step")
    export_hf: bool = True
    """Write the trained model to RUN_DIR/hf_final (``save_pretrained``, fp32) when training ends."""
    moe_aux_loss_coeff: float | None = Field(None, ge=0, description="the router loss's weight; 0: off")
    """Mixture-of-experts models: weight of the router load-balancing loss (``toolkit/adapters/moe.py``);
    default: the HF config's ``router_aux_loss_coef``. 0 turns it off."""
    objective: Literal["sft", "dpo", "orpo"] = "sft"
    """``sft``: the mean token cross-entropy; on preference pairs (``PREFERENCE_OBJECTIVES``) ``dpo`` (``dpo.*``,
    a reference scored once before training) or ``orpo`` (``orpo.*``, none). One file each: ``toolkit/objectives/``."""

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> "TrainConfig":
        if self.min_lr is None:  # follows lr, so setting a lower lr alone is never refused
            # object.__setattr__: validate_assignment would rerun this validator
            object.__setattr__(self, "min_lr", self.lr / 10)
        if self.min_lr > self.lr:  # the schedule would climb from lr to min_lr
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}: the schedule decays "
                             "from lr to min_lr; set train.min_lr <= train.lr (0 decays to zero, equal keeps lr "
                             "constant)")
        return self


class ZeroConfig(_Section):
    stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    ds_config: str | None = None
    """A DeepSpeed JSON (path, or a name in ds_configs/: zero0..zero3, zero3_offload); "auto"
    values in it are filled from this run config. Default: ds_configs/zero{stage}.json."""
    sp: int = Field(1, ge=1)
    """DeepSpeed's Ulysses sequence parallelism (``adapters/deepspeed/ulysses.py``): each row's tokens split over
    ``sp`` consecutive ranks, attention heads exchanged by all-to-all, so a rank holds the activations of
    seq_len / sp tokens; world = dp x sp (ZeRO shards over the whole world). Needs the attention heads
    and seq_len divisible by sp (the plan names the valid sizes)."""
    ep: int = Field(1, ge=1)
    """Expert parallelism of a mixture-of-experts model through DeepSpeed's AutoEP
    (``adapters/deepspeed/moe.py``): each of ep consecutive ranks holds num_experts / ep experts of every
    MoE layer and the tokens go to their experts by all-to-all; the rest of the model stays data
    parallel. Needs a family with an AutoEP preset (mixtral, qwen2_moe, qwen3_moe), experts and the
    world divisible by ep (the plan names the valid sizes)."""
    tiled_mlp: bool = False
    """Each decoder layer's MLP through DeepSpeed's ``TiledMLP`` (``adapters/deepspeed/tiles.py``): the sequence in
    ceil(seq / hidden) tiles, the MLP's [tokens, intermediate] activations existing one tile at a time
    and recomputed in the backward. Dense gate/up/down MLPs only (MoE models are refused)."""
    tiled_loss: bool = False
    """The lm_head and the loss taken a tile of tokens at a time (``loss.tiled_token_loss_sum``): the
    [tokens, vocab] logits never exist whole, each tile's recomputed in the backward. SFT only."""
    offload_activations: bool = False
    """With model.activation_checkpointing: each checkpointed layer's saved input (micro-batch x
    seq_len / sp x hidden per layer, in the model's dtype) kept in host memory, pinned on GPUs, instead
    of on the device, as DeepSpeed's ALST does for long sequences (``device.host_checkpoint``: torch's
    ``save_on_cpu`` around its checkpoint). Saves layers x that on the device; costs as much host
    memory per rank and a device-to-host copy of each layer's input in the forward and back in the
    backward, on the compute stream (a slower step). The math is unchanged."""

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_not_boolean(cls, v):
        if isinstance(v, bool):  # a Literal of ints takes True as 1, even when strict
            raise ValueError("expected one of 0, 1, 2, 3, got a boolean")
        return v


class MegatronConfig(_Section):
    tp: int = Field(1, ge=1, description="tensor parallel ranks")
    """Tensor parallel degree: attention heads, KV groups and the MLP split over tp ranks."""
    pp: int = Field(1, ge=1, description="pipeline stages")
    """Pipeline parallel degree: layers split over pp stages (1F1B schedule)."""
    vpp: int | None = Field(None, ge=1, description="virtual stages per pipeline rank; unset: one")
    """Virtual pipeline stages per rank (interleaved 1F1B); layers must divide by pp x vpp."""
    first_stage_layers: int | None = Field(None, ge=1, description="layers on the first pipeline stage")
    """Uneven pipeline split: layers on the first stage (the rest divide evenly over the others)."""
    last_stage_layers: int | None = Field(None, ge=1, description="layers on the last pipeline stage")
    """Uneven pipeline split: layers on the last stage."""
    sequence_parallel: bool = False
    """Split norm and dropout activations along the sequence over the TP ranks (needs tp >= 2 and
    seq_len divisible by tp); all-reduces become reduce-scatter + all-gather."""
    cp: int = Field(1, ge=1, description="context parallel ranks")
    """Context parallel degree: each sequence split over cp ranks (2 x cp chunks, rank r holding
    chunks r and 2cp-1-r, megatron's load-balanced causal layout); the toolkit's core attention
    exchanges heads for sequence with an all-to-all (Ulysses-style), so heads / tp and KV heads / tp
    are divided over cp (KV heads replicated when fewer) and seq_len must divide by 2 x cp."""
    ep: int = Field(1, ge=1, description="expert parallel ranks")
    """Expert parallel degree (mixture-of-experts models): each of ep ranks of a DP group holds
    num_experts / ep experts; tokens are exchanged with the MoE token dispatcher."""
    moe_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    """megatron's MoE token dispatcher; alltoall needs a GPU (NCCL), allgather runs anywhere."""
    make_vocab_size_divisible_by: int = Field(128, ge=1, description="the vocabulary's padding multiple")
    """Vocabulary padded to a multiple of this x tp; padded logits never reach the loss."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: selective (core attention) or full (every layer)."""
    attention: Literal["auto", "sdpa", "flex", "local"] = "auto"
    """Core attention. ``auto``/``sdpa``/``flex``: the toolkit's module (torch's
    scaled_dot_product_attention / flex_attention; RoPE from per-token positions, document masks;
    no s x s scores kept), ``auto`` picking the kernel per device and need; ``flex`` needs a GPU to
    train (torch has no flex_attention backward on CPU). ``local``: megatron-core's own
    DotProductAttention and RoPE (materializes the scores; for comparison). Same weights either way."""
    fused_kernels: bool = True
    """On GPUs only: megatron's torch-compiled bias-dropout-add, and its SwiGLU when the model's MLP is
    SwiGLU (no Transformer Engine or Apex needed; the same math). Always off on CPU."""
    preset: str | None = None
    """A megatron_configs/ YAML (name or path) of layout fields; explicit megatron.* keys win."""
    initial_loss_scale: float = Field(2.0**16, ge=1, description="fp16's first loss scale (megatron's minimum is 1)")
    """model.dtype=fp16: the dynamic loss scale's start, as DeepSpeed's presets (initial_scale_power
    16); halved on each overflowing step (that step's update skipped), doubled after 1000 clean ones.
    megatron-core's own default, 2^32, skips the first dozen steps while the LR schedule advances."""

    @model_validator(mode="after")
    def _one_virtual_stage(self) -> "MegatronConfig":
        if self.vpp == 1:
            self.vpp = None  # one virtual stage is the plain 1F1B schedule
        return self


class CheckpointConfig(_Section):
    every: int = Field(100, ge=0)
    """Save every N steps and at the last step; 0: never (a preemption still saves)."""
    keep_last: int = Field(2, ge=0, description="complete checkpoints kept; 0: all")
    async_save: bool = False
    """Block only while the checkpoint is written to ``local_dir``; copy it to RUN_DIR in the background
    and commit it (COMPLETE, latest) once every node has persisted it."""
    local_dir: str | None = None
    """Node-local storage for asynchronous saves (default: /dev/shm, else $TMPDIR); each node needs
    room for its ranks' share of one checkpoint, else that save is made synchronously."""


class RestartConfig(_Section):
    max_restarts: int = Field(0, ge=0, description="restarts of the job before giving up")
    """Restarts of the whole job (from the newest complete checkpoint) before giving up."""
    backoff_s: float = Field(1.0, ge=0, description="seconds before the first restart, doubled each time")
    """Wait before restart k: backoff_s x 2^(k-1), capped at 30 s."""
    hang_timeout_s: float = Field(300.0, ge=0)
    """A rank silent this long in a step (or an eval batch) is hung: stacks are dumped, the job is
    restarted (0 = off, every phase). Load, reshard, save and export have budgets of their own:"""
    io_bytes_per_s: float = Field(100e6, gt=0)
    """The slowest read/write rate a healthy rank sees (a loaded shared filesystem): the default
    budget of load, reshard, save and export is hang_timeout_s + the model's bytes / this
    (``toolkit/watch/budgets.py``)."""
    startup_s: float = Field(300.0, gt=0)
    """What a rank's load costs before it moves the model's bytes (imports, process group, tokenizer,
    a first build of DeepSpeed's CPU ops): the default load budget is this + the model's bytes / io_bytes_per_s."""
    load_timeout_s: float | None = Field(None, gt=0)
    """Longest silence from the start of a rank (or a restart) through resuming; None: the rule above."""
    reshard_timeout_s: float | None = Field(None, gt=0)
    """...while converting a checkpoint written at another layout."""
    save_timeout_s: float | None = Field(None, gt=0)
    """...while writing a checkpoint (beaten per file written)."""
    export_timeout_s: float | None = Field(None, gt=0)
    """...while writing hf_final (beaten per tensor)."""
    eval_timeout_s: float | None = Field(None, gt=0)
    """...in an eval (beaten per micro-batch); None: hang_timeout_s."""
    join_timeout_s: float | None = Field(None, gt=0)
    """Multi-node: how long a node waits at the rendezvous (the first start and every restart) for
    the other nodes before it fails, naming the nodes that never joined; None: 60 s + 0.25 s per
    node (``toolkit/launch/roster.py``). Counted from when this node reaches the rendezvous, after
    its own data preparation."""
    straggler_every: int = Field(50, ge=0, description="steps between straggler checks; 0: off")
    """Compare per-rank compute time every N steps (0 = off)."""
    straggler_factor: float = Field(1.5, ge=1, description="times the median step time that makes a straggler")
    """A rank slower than this factor x the median of its peers is named a straggler..."""
    straggler_min_gap_s: float = Field(0.05, ge=0, description="seconds a straggler must lag by")
    """...and by at least this many seconds per step (tiny steps are all noise)."""
    divergence_every: int = Field(100, ge=0, description="steps between replica checksums; 0: off")
    """Compare a checksum of DP-replicated parameters every N steps (0 = off)."""


class ProfileConfig(_Section):
    enabled: bool = False
    """Record a torch.profiler trace of a few steps and summarise compute vs collectives (``--profile``)."""
    start_step: int = Field(3, ge=1)
    """First profiled step (the steps before it are warm-up)."""
    steps: int = Field(3, ge=1)


class MetricsConfig(_Section):
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (``pip install 'toolkit[wandb]'``; set
    WANDB_MODE=offline on machines without network). TensorBoard logs whenever it is installed."""


class LoraConfig(_Section):
    """LoRA fine-tuning on either backend (peft on the DeepSpeed path, the same adapters split over
    TP on megatron): the base model frozen, low-rank adapters on ``target_modules`` (and
    ``modules_to_save`` in full) trained. Checkpoints hold the adapters
    only; ``hf_final/`` is the merged model and ``adapter/`` the HF-PEFT directory."""
    rank: int = Field(0, ge=0)
    """Adapter rank r; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = Field(16.0, gt=0)
    """Scaling numerator: the adapter's update is (alpha / rank) x B @ A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input (the base path has none)."""
    target_modules: list[str] = ["all-linear"]
    """HF module names (``q_proj``, ``c_attn``, a dotted suffix such as ``shared_expert.down_proj``)
    or ``all-linear``: every linear layer but the output layer and the MoE router."""
    modules_to_save: list[str] = []
    """Modules trained in full beside the adapters (``lm_head``, ``embed_tokens``)."""

    @field_validator("target_modules", "modules_to_save", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, str) else v  # --set lora.target_modules=all-linear

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class DpoConfig(_Section):
    """Direct preference optimization (``train.objective: dpo``), as TRL's ``DPOTrainer`` defines it."""
    beta: float = Field(0.1, gt=0, description="the tie to the reference model (IPO: the regularization tau)")
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """``sigmoid``: -log sigmoid(beta x margin) (DPO); ``ipo``: (margin / answer tokens - 1 / (2 beta))^2
    with each answer's log-ratio averaged over its tokens (TRL's IPO); ``hinge``: relu(1 - beta x margin)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="sigmoid only: the probability e that a "
                                   "label is flipped (conservative DPO: -(1-e) log s(beta m) - e log s(-beta m))")


class OrpoConfig(_Section):
    """Odds-ratio preference optimization (``train.objective: orpo``), as TRL's ``ORPOTrainer`` defines it."""
    beta: float = Field(0.1, gt=0, description="TRL's beta (the paper's lambda): the odds-ratio term's weight")


class RunConfig(_Section):
    backend: Literal["deepspeed", "megatron"] = "deepspeed"
    nproc: int = Field(2, ge=1, description="local ranks to start (--nproc), one per GPU")
    run_dir: str = "runs/demo"
    resume: Literal["auto", "never"] = "auto"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    zero: ZeroConfig = ZeroConfig()
    megatron: MegatronConfig = MegatronConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    restart: RestartConfig = RestartConfig()
    profile: ProfileConfig = ProfileConfig()
    metrics: MetricsConfig = MetricsConfig()
    lora: LoraConfig = LoraConfig()
    dpo: DpoConfig = DpoConfig()
    orpo: OrpoConfig = OrpoConfig()

    @model_validator(mode="after")
    def _objective_fits_data(self) -> "RunConfig":
        """The preference objectives train on preference pairs and preference pairs train only with them."""
        objective = self.train.objective
        pairs, preference = objective in PREFERENCE_OBJECTIVES, self.data.template == "preference"
        if pairs and not preference:
            raise ValueError(f"train.objective={objective} needs preference pairs, but "
                             f"data.template={self.data.template}; set data.template=preference (with "
                             "data.prompt_column, data.chosen_column, data.rejected_column)")
        if preference and not pairs:
            raise ValueError(f"data.template=preference holds pairs that only the preference objectives use, but "
                             f"train.objective={objective}; set train.objective=dpo (or orpo)")
        if pairs and self.data.packing_mode == "concat":
            raise ValueError(f"train.objective={objective} needs whole documents per pair: data.packing=concat "
                             "cuts them; use data.packing=documents (or pad)")
        split = {"megatron.cp": self.megatron.cp} if self.backend == "megatron" else {"zero.sp": self.zero.sp}
        (key, size), = split.items()
        if pairs and size > 1:  # a document's log-probability sum would span the ranks of its row
            raise ValueError(f"train.objective={objective} does not run with {key}={size} yet (each answer's "
                             f"log-probability sum would be split over the ranks of its row); set {key}=1")
        tiled = [f"zero.{k}" for k in ("tiled_mlp", "tiled_loss") if getattr(self.zero, k)]
        if tiled and self.backend == "megatron":
            raise ValueError(f"{' and '.join(tiled)} tile the HF model on DeepSpeed, but backend=megatron; unset "
                             f"{', '.join(tiled)} (megatron's own recompute and its vocabulary-parallel loss apply)")
        self._offload_activations_fits()
        if pairs and self.zero.tiled_loss:
            raise ValueError(f"zero.tiled_loss=true takes the token cross-entropy only; train.objective={objective} "
                             "needs per-token log-probabilities from whole logits: set zero.tiled_loss=false")
        if self.dpo.label_smoothing and self.dpo.loss != "sigmoid":
            raise ValueError(f"dpo.label_smoothing={self.dpo.label_smoothing} applies to dpo.loss=sigmoid only "
                             f"(dpo.loss={self.dpo.loss}); set dpo.label_smoothing=0")
        return self

    @model_validator(mode="after")
    def _other_backend_untouched(self) -> "RunConfig":
        """The section of the backend not in use stays at its defaults: its keys would be ignored
        (``megatron.tp=2`` on DeepSpeed ran dp=2). A run's config.yaml, which writes every key, loads."""
        section = {"deepspeed": "megatron", "megatron": "zero"}[self.backend]
        owner, name = {"zero": ("deepspeed", "DeepSpeed's"), "megatron": ("megatron", "megatron's")}[section]
        values, defaults = getattr(self, section), type(getattr(self, section))()
        changed = [f"{section}.{k}={getattr(values, k)!r}" for k in type(values).model_fields
                   if getattr(values, k) != getattr(defaults, k)]
        if changed:
            keys = ", ".join(c.partition("=")[0] for c in changed)
            raise ValueError(f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} {name} "
                             f"(backend={owner}), ignored by backend={self.backend}; unset {keys} (or set "
                             f"backend={owner})")
        return self

    def _offload_activations_fits(self) -> None:
        """zero.offload_activations moves what HF's activation checkpointing keeps, on DeepSpeed only."""
        if not self.zero.offload_activations:
            return
        if self.backend == "megatron":
            raise ValueError("zero.offload_activations=true offloads the HF model's checkpointed layer inputs on "
                             "DeepSpeed, but backend=megatron; unset zero.offload_activations (megatron-core has its "
                             "own activation offloading, cpu_offloading in its TransformerConfig)")
        if not self.model.activation_checkpointing:
            raise ValueError("zero.offload_activations=true keeps each checkpointed layer's input on the host, but "
                             "model.activation_checkpointing=false keeps every activation on the device; set "
                             "model.activation_checkpointing=true (or unset zero.offload_activations)")


# --- loading -----------------------------------------------------------------------------------

def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read YAML (or nothing: the embedded demo), apply ``key=value`` overrides, validate.
    ``overrides``: strings as ``--set`` takes them (``"train.steps=100"``, values parsed as YAML).
    Raises ``ConfigError`` naming the field and the fix (a YAML mistake: the file, line and column)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        raw = read_yaml_file(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item)
    return validate(raw)


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.steps=100")
    key, _, text = item.partition("=")
    try:
        value = parse_yaml(text, f"--set {item!r}", line_numbers=False) if text.strip() else ""
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(": not valid YAML:", ": the value is not valid YAML:")) from None
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict) -> RunConfig:
    _check_unknown_keys(raw, RunConfig, prefix="")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [explain(err, RunConfig) for err in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def _check_unknown_keys(raw: dict, model: type[BaseModel], prefix: str) -> None:
    fields = model.model_fields
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(prefix + f for f in fields)}"
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
        sub = fields[key].annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            _check_unknown_keys(value, sub, prefix=f"{prefix}{key}.")


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
