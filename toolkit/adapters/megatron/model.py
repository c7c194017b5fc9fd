"""megatron-core model chunks from the run plan: the TransformerConfig, the local layer spec (with
sequence-parallel norms, the toolkit's core attention and its load-balancing router), one GPTModel
per virtual stage."""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from toolkit import device
from toolkit.adapters.compiled import compile_works
from toolkit.adapters.megatron import grid
from toolkit.adapters.megatron.attention import AttentionOptions, core_attention_class
from toolkit.adapters.megatron.experts import EAGER, GROUPED, grouped_sequential_mlp_class
from toolkit.adapters.megatron.qk_norm import FullWidthRMSNorm
from toolkit.adapters.megatron.weights import rope_inv_freq
from toolkit.config import RunConfig
from toolkit.engine import DTYPES
from toolkit.families.base import LayerSpec
from toolkit.layout import Layout


def transformer_config(cfg: RunConfig, lay: Layout, hf_config, family):
    """megatron's TransformerConfig: the family's fields, the layout, the precision, every fused
    kernel that needs Transformer Engine or Apex off (neither is installed), and on GPUs the
    torch-compiled ones that need neither (``gpu_fusions``)."""
    from megatron.core.transformer import TransformerConfig
    dtype = DTYPES[cfg.model.dtype]
    kw = family.transformer_config(hf_config)
    # perform_initialization stays on although every weight is then overwritten from the HF
    # tensors: megatron marks TP-split weights (tensor_model_parallel, partition_dim) only in its
    # init path, and the grad norm counts unmarked weights once per TP group, not per shard. Its
    # init methods draw nothing (``weights.py`` fills every parameter, seeded or pretrained, once
    # DDP has made it a view of its buffer): a draw would be wasted.
    kw.update(init_method=_filled_by_loader, output_layer_init_method=_filled_by_loader,
              embedding_init_method=_filled_by_loader)
    kw.update(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
              virtual_pipeline_model_parallel_size=lay.vpp, sequence_parallel=lay.sequence_parallel,
              context_parallel_size=lay.cp,
              num_layers_in_first_pipeline_stage=lay.first_stage_layers,
              num_layers_in_last_pipeline_stage=lay.last_stage_layers,
              params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
              calculate_per_token_loss=True, bias_activation_fusion=False, masked_softmax_fusion=False,
              bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
              gradient_accumulation_fusion=False, **_recompute(lay.recompute))
    if lay.vpp:
        # Megatron-LM's interleaved default. With batched p2p, at pp = 2 (the previous and the next
        # stage are one peer) the steady state sends an activation and a gradient to that peer in
        # one batch on one group while the peer posts its receives in the other order: on gloo the
        # two swap (same shapes, wrong gradients). The overlapped path uses a group per direction.
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if family.num_experts(hf_config):
        # The load-balancing loss is the toolkit's (LoadBalancedRouter), not megatron's.
        kw.update(expert_model_parallel_size=lay.ep, moe_token_dispatcher_type=cfg.megatron.moe_dispatcher,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                  moe_permute_fusion=False, moe_router_fusion=False)
    if not torch.cuda.is_available():
        # Not megatron_cpu.TRANSFORMER_CONFIG's CPU initialization: it writes every weight (its
        # slice of a whole fp32 master, ``_initialize_affine_weight_cpu``), pages that
        # ``release_storage`` then frees but glibc keeps (the shard twice again at DDP's buffer).
        # megatron's device path with the no-op init leaves them untouched.
        kw.update(use_cpu_initialization=False)
    elif cfg.megatron.fused_kernels and compile_works("cuda"):  # torch.compile'd: off where it fails (one line)
        kw.update(gpu_fusions(kw))
    return TransformerConfig(**kw)


def _filled_by_loader(weight: torch.Tensor) -> torch.Tensor:
    """megatron's init method for every weight: none (the loader writes each one)."""
    return weight


def gpu_fusions(kw: dict) -> dict:
    """megatron's fusions that need neither TE nor Apex (``megatron.core.jit``: torch.compile), on
    GPUs, where they compute the same expressions: bias-dropout-add (``residual + dropout(x +
    bias)``) always; the activation only for SwiGLU (``silu(gate) * up``, its backward written out).
    megatron's fused GeLU is a tanh approximation with a rounded constant, so GeLU models (gpt2)
    keep the unfused activation. Their outputs may differ from the unfused ops in the last bits (a
    kernel's own rounding), and dropout masks come from another random stream."""
    swiglu = kw.get("gated_linear_unit") and kw.get("activation_func") is torch.nn.functional.silu
    return {"bias_dropout_fusion": True, "bias_activation_fusion": bool(swiglu)}


def attention_options(cfg: RunConfig, hf_config, family, tconfig) -> AttentionOptions | None:
    """The toolkit's core attention for ``megatron.attention`` (None: megatron's local one), with
    HF's RoPE frequencies on this rank's device for RoPE families."""
    if cfg.megatron.attention == "local":
        return None
    inv_freq = None
    if family.position_embedding == "rope":
        inv_freq = rope_inv_freq(hf_config, tconfig.kv_channels).to(device.rank_device())
    softcap = family.attention_softcap(hf_config) if family.attention_softcap else None
    return AttentionOptions(mode=cfg.megatron.attention, inv_freq=inv_freq, windows=family.sliding_windows(hf_config),
                            softcap=softcap)


def _recompute(mode: str) -> dict:
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def build_chunks(lay: Layout, hf_config, family, tconfig, attention: AttentionOptions | None = None,
                 experts: str = EAGER) -> list:
    """This rank's GPTModel chunk(s): one per virtual pipeline stage, holding only its layers.
    With the toolkit's attention, megatron's RoPE is off: the attention rotates q and k itself.
    ``experts``: ``grouped_mm`` or ``eager`` (``experts.choose``)."""
    from megatron.core.models.gpt import GPTModel
    vpp = lay.vpp
    kwargs = family.model_kwargs(hf_config)
    if attention is not None and kwargs["position_embedding_type"] == "rope":
        kwargs["position_embedding_type"] = "none"
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        pre, post = grid.stage_ends(vp)
        spec = layer_spec(tconfig, vp, attention, family.layer_spec, tp=lay.tp, experts=experts)
        chunks.append(GPTModel(tconfig, spec, vocab_size=lay.padded_vocab, vp_stage=vp, pre_process=pre,
                               post_process=post, **kwargs))
        # megatron makes its linear layers on the device, but torch norms (its own WrappedTorchNorm,
        # the toolkit's ToolkitNorm and post-norms) on the default device: all of it to the rank's
        _on_rank_device(chunks[-1])
        _in_model_dtype(chunks[-1], tconfig.params_dtype)
        if family.embedding_scale and chunks[-1].pre_process:
            _scale_embedding(chunks[-1].embedding, family.embedding_scale(hf_config))
        cap = family.logit_softcap(hf_config) if family.logit_softcap else None
        if cap and chunks[-1].post_process:
            _softcap_logits(chunks[-1].output_layer, cap)
    return chunks


def _in_model_dtype(chunk, dtype: torch.dtype) -> None:
    """Every floating parameter in the model dtype, as megatron's ``Float16Module`` leaves a bf16 /
    fp16 model (HF's bf16 model too): megatron makes its linear layers in ``params_dtype`` but torch
    norms (``WrappedTorchNorm``, ``ToolkitNorm``, post-norms) in fp32, which torch runs unfused
    against bf16 activations (and some versions promote the activations to fp32). The distributed
    optimizer keeps fp32 masters of them, as of every bf16 parameter."""
    with torch.no_grad():
        for param in chunk.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


def _softcap_logits(output_layer, cap: float) -> None:
    """``cap * tanh(logits / cap)`` on the LM head's output, as HF's Gemma 2 head: elementwise, so
    each TP rank caps its own vocabulary slice before the loss sees it."""
    def hook(module, args, output):
        logits, bias = output
        return torch.tanh(logits / cap) * cap, bias
    output_layer.register_forward_hook(hook)


def _on_rank_device(chunk) -> None:
    """Moves only what is elsewhere (a no-op on CPU, where the strict device mode would mark every
    weight a ``.to("cpu")`` touches as a host tensor)."""
    rank_device = device.rank_device()
    if any(t.device != rank_device for t in (*chunk.parameters(), *chunk.buffers())):
        chunk.to(rank_device)


def _scale_embedding(embedding, scale: float) -> None:
    """The lookup times ``scale``, rounded to the weights' dtype first as HF does (Gemma's
    ``embed_scale.to(weight.dtype)``); megatron's embedding has no such factor."""
    factor = torch.tensor(scale, dtype=torch.float32)
    embedding.register_forward_hook(lambda module, args, output: output * factor.to(output.dtype).to(output.device))


def layer_spec(tconfig, vp_stage: int | None, attention: AttentionOptions | None = None,
               structure: LayerSpec = LayerSpec(), *, tp: int, experts: str = EAGER):
    """megatron's local layer spec (torch norms; MoE: ``LoadBalancedRouter`` and sequential experts, or
    with ``experts=grouped_mm`` the toolkit's ``GroupedSequentialMLP`` (``experts.py``: the same parameters);
    ``attention``: the toolkit's core attention, else megatron's DotProductAttention) with the
    family's ``structure`` (``_apply_structure``; ``tp``: the layout's); with sequence parallelism or zero-centered norm
    weights, a block spec whose norms are ``ToolkitNorm`` (megatron's own torch-norm wrapper refuses
    both)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    spec = get_gpt_layer_local_spec(num_experts=tconfig.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=tconfig.qk_layernorm, normalization=tconfig.normalization)
    if attention is not None:
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=core_attention_class(), params={"options": attention})
    if tconfig.num_moe_experts:
        spec.submodules.mlp.submodules.router = load_balanced_router_class()
        if experts == GROUPED:
            spec.submodules.mlp.submodules.experts.module = grouped_sequential_mlp_class()
    _apply_structure(spec, structure, tconfig, tp)
    if not (tconfig.sequence_parallel or tconfig.layernorm_zero_centered_gamma):
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    if structure.pre_norms:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = ToolkitNorm
    if tconfig.qk_layernorm:  # per head, on this rank's heads of the whole sequence: a partial gradient too
        attention_parts = spec.submodules.self_attention.submodules
        attention_parts.q_layernorm = attention_parts.k_layernorm = ToolkitNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tconfig, vp_stage=vp_stage),
                                      layer_norm=ToolkitNorm)


def _apply_structure(spec, structure: LayerSpec, tconfig, tp: int) -> None:
    """A family's ``LayerSpec`` on megatron's local layer spec: no pre-norms (``IdentityOp``), a
    norm after each output projection (``post_normed_linear_class``), q/k norms over all heads'
    width (``FullWidthRMSNorm``; per-head ones are megatron's ``qk_layernorm``)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    if not structure.pre_norms:
        layer.input_layernorm = layer.pre_mlp_layernorm = IdentityOp
    if structure.post_norms:  # a norm on each output projection's result, before the residual add
        if tconfig.num_moe_experts:
            raise ValueError("post norms on mixture-of-experts layers are not in the toolkit's layer spec")
        attention.linear_proj = post_normed_linear_class()
        layer.mlp.submodules.linear_fc2 = post_normed_linear_class()
    if structure.qk_norm == "full":
        attention.q_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": "q", "tp": tp})
        attention.k_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"heads": "k", "tp": tp})


class ToolkitNorm:
    """The norms megatron's own torch-norm wrapper (``WrappedTorchNorm``) refuses: under sequence
    parallelism and with weights centered on zero (Gemma's (1 + w) RMSNorm). A torch ``LayerNorm`` /
    ``RMSNorm``, or ``ZeroCenteredRMSNorm``; under sequence parallelism its parameters are marked
    ``sequence_parallel``: each TP rank normalizes its own ``[seq / tp, batch, hidden]`` slice, so
    each holds a partial gradient of the (replicated) norm weights, which megatron's
    ``finalize_model_grads`` sums over the TP group, as it does for Transformer Engine's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization={config.normalization!r}: the toolkit's norms are {sorted(norms)}")
        if config.layernorm_zero_centered_gamma and config.normalization != "RMSNorm":
            raise ValueError("layernorm_zero_centered_gamma: the toolkit has it for RMSNorm only")
        norm = (ZeroCenteredRMSNorm if config.layernorm_zero_centered_gamma else norms[config.normalization])(
            hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is stored centered on zero and scales by (1 + w), computed in fp32 and
    cast back as HF's ``GemmaRMSNorm`` does (megatron's ``layernorm_zero_centered_gamma``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


@lru_cache(maxsize=1)
def post_normed_linear_class():
    """megatron's ``RowParallelLinear`` followed by a ``ToolkitNorm`` of its (reduced) output: the
    norm's weight is ``<linear>.post_norm.weight``, replicated in checkpoints; under sequence
    parallelism each rank normalizes its slice and the gradients are summed over TP. The norm is a
    forward hook registered at build time, so a LoRA delta hook prepended later (``lora.attach``)
    adds to the projection's output before the norm, as peft's adapted ``o_proj`` does in HF."""
    from megatron.core.tensor_parallel import RowParallelLinear

    class PostNormedRowParallelLinear(RowParallelLinear):
        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_norm = ToolkitNorm(config, output_size, eps=config.layernorm_epsilon)
            self.register_forward_hook(_post_norm)

    return PostNormedRowParallelLinear


def _post_norm(module, args, output):
    output, bias = output
    if bias is not None:
        raise ValueError("post norms with a bias on the output projection are not in the toolkit")
    return module.post_norm(output), None


@lru_cache(maxsize=1)
def load_balanced_router_class():
    """megatron's ``TopKRouter`` that adds the toolkit's load-balancing loss (``toolkit/adapters/moe.py``, the
    same definition as the DeepSpeed path) to its routing, and records tokens per expert.

    Per training forward of a micro-batch and layer: ``aux`` from this rank's logits and the tokens
    per expert of the whole sequence (summed over the ranks that split it: TP under sequence parallelism, CP
    under context parallelism), attached to the routing probabilities with weight ``aux_scale``
    (None: not attached), which the engine sets each step. Not in eval, and once per micro-batch under recomputation
    (the recomputing forward is the one with gradients)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from toolkit.adapters import moe

    class LoadBalancedRouter(TopKRouter):
        aux_scale: "float | torch.Tensor | None" = None
        stats: "moe.RouterStats | None" = None

        def routing(self, logits, padding_mask=None):
            """``padding_mask``: megatron's ``[s or s / tp, b]`` (True = padding; GPTModel's
            ``padding_mask`` from the engine, rows packed by documents), left out of the statistics."""
            flat = logits.reshape(-1, self.config.num_moe_experts)
            padding_mask = _local_rows(padding_mask, flat.shape[0])
            probs, routing_map = super().routing(logits, padding_mask)
            if not (self.training and torch.is_grad_enabled()):
                return probs, routing_map
            real = None if padding_mask is None else ~padding_mask
            counts, tokens = self._counts_and_tokens(routing_map, real)
            aux = moe.load_balancing_loss(flat, counts, tokens, real)
            if self.stats is not None:  # TP and CP ranks hold the same counts and partial aux sums
                first = grid.tp_rank() == 0 and grid.cp_rank() == 0
                self.stats.add(self.layer_number - 1, counts if first else None, aux.detach())
            if self.aux_scale is not None:
                probs = moe.AttachLoss.apply(probs, aux * self.aux_scale)
            return probs, routing_map

        def _counts_and_tokens(self, routing_map, real):
            """Tokens per expert ``[E]`` and the token count of the whole sequence (summed over the
            ranks that split it: TP under sequence parallelism, CP under context parallelism, in one
            all-reduce), kept on the device: masks, not boolean indexing, which would wait for the
            device to size its output."""
            rows, sp = routing_map.shape[0], self.config.sequence_parallel
            group = grid.sequence_group(sp)
            shares = dist.get_world_size(group) if group is not None else 1  # the ranks the counts sum over
            if real is not None:
                routing_map = routing_map & real.unsqueeze(-1)
            counts = routing_map.sum(dim=0)
            if real is None:  # every row a token: the count is known on the host
                if group is not None:
                    dist.all_reduce(counts, group=group)
                return counts, rows * shares
            both = torch.cat([counts, real.sum().reshape(1)])
            if group is not None:
                dist.all_reduce(both, group=group)
            return both[:-1], both[-1].clamp(min=1)

    def _local_rows(padding_mask, rows: int):
        """The mask flattened over this rank's ``rows`` tokens (s-major, as the logits). GPTModel scatters
        it under sequence parallelism on the first pipeline stage only: a later stage gets the
        whole ``[s, b]``, of which this TP rank routes the r-th contiguous share."""
        if padding_mask is None:
            return None
        flat = padding_mask.reshape(-1).bool()
        if flat.numel() == rows:
            return flat
        rank = grid.tp_rank()
        return flat[rank * rows:(rank + 1) * rows]

    return LoadBalancedRouter
