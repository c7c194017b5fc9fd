"""torchtitan checkpoints without torchtitan (it is not installable here): an HF tiny model's state as
torchtitan's own Llama 3 / Qwen 3 models name and lay it out, saved through DCP the way torchtitan's
``CheckpointManager`` saves ``step-N/``, and a small re-implementation of torchtitan's forward over
that state, so that the layout is checked against HF's logits rather than assumed.

Independent of the converter's table (``toolkit/families``): the names are written out here as
torchtitan's ``state_dict_adapter`` documents them (``from_hf_map``), and the q/k rows are laid out
for torchtitan's complex RoPE (``ComplexRoPE``: adjacent dims (2j, 2j+1) of a head rotate together;
HF rotates dims j and j + d/2) by the inverse of what the converter does, whose correctness
``titan_logits`` (torchtitan's rotation over these rows) against HF's forward shows.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

NEW = {"q": "attention.qkv_linear.wq", "k": "attention.qkv_linear.wk", "v": "attention.qkv_linear.wv",
       "out": "lm_head.weight"}
OLD = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "out": "output.weight"}
"""torchtitan's names since its fused-QKV module, and before (older releases' checkpoints)."""


def titan_names(num_layers: int, qk_norm: bool, names: dict = NEW) -> dict[str, str]:
    """HF name -> torchtitan name, as torchtitan's llama3 / qwen3 ``from_hf_map`` spells them."""
    out = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": names["out"]}
    for i in range(num_layers):
        hf, tt = f"model.layers.{i}.", f"layers.{i}."
        out.update({hf + "self_attn.q_proj.weight": tt + names["q"] + ".weight",
                    hf + "self_attn.k_proj.weight": tt + names["k"] + ".weight",
                    hf + "self_attn.v_proj.weight": tt + names["v"] + ".weight",
                    hf + "self_attn.o_proj.weight": tt + "attention.wo.weight",
                    hf + "mlp.gate_proj.weight": tt + "feed_forward.w1.weight",
                    hf + "mlp.up_proj.weight": tt + "feed_forward.w3.weight",
                    hf + "mlp.down_proj.weight": tt + "feed_forward.w2.weight",
                    hf + "input_layernorm.weight": tt + "attention_norm.weight",
                    hf + "post_attention_layernorm.weight": tt + "ffn_norm.weight"})
        if qk_norm:
            out.update({hf + "self_attn.q_norm.weight": tt + "attention.q_norm.weight",
                        hf + "self_attn.k_norm.weight": tt + "attention.k_norm.weight"})
    return out


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def to_pairs(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF's rotate-half rows of each head (j, j + d/2) -> interleaved (2j, 2j + 1)."""
    rows = x.shape[0]
    return x.reshape(rows // head_dim, 2, head_dim // 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def titan_state(hf_state: dict, config, names: dict = NEW) -> dict[str, torch.Tensor]:
    """An HF state dict as torchtitan's model holds it (Llama 3: q/k rows interleaved for its RoPE;
    tied: ``lm_head`` and the embedding both, as torchtitan's weight-tied model's state dict has)."""
    interleaved = config.model_type == "llama"
    table = titan_names(config.num_hidden_layers, config.model_type == "qwen3", names)
    hf_state = dict(hf_state)
    if config.tie_word_embeddings:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
    out = {}
    for hf, tensor in hf_state.items():
        if interleaved and hf.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = to_pairs(tensor, _head_dim(config))
        out[table[hf]] = tensor.clone()
    return out


def _rms(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def titan_logits(sd: dict, config, ids: torch.Tensor, names: dict = NEW) -> torch.Tensor:
    """torchtitan's decoder forward re-implemented over its own state dict (fp32, causal): Llama 3's
    complex RoPE on adjacent pairs, Qwen 3's rotate-half RoPE after per-head q/k RMSNorm; the RoPE
    frequencies are HF's own (``inv_freq`` and attention scaling of the model's rotary module), since
    the pairing of dims, not the frequencies, is what differs."""
    from transformers import AutoModelForCausalLM
    rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
    inv_freq, scale = rotary.inv_freq.float(), getattr(rotary, "attention_scaling", 1.0)
    b, s = ids.shape
    hd, nh, nkv = _head_dim(config), config.num_attention_heads, config.num_key_value_heads
    eps, interleaved = config.rms_norm_eps, config.model_type == "llama"
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)  # [s, d/2]
    h = sd["tok_embeddings.weight"][ids]

    def rope(x):  # [b, s, heads, d]
        if interleaved:
            cis = torch.polar(torch.ones_like(angles), angles) * scale
            z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(z * cis[None, :, None]).flatten(-2)
        cos, sin = (torch.cat([angles, angles], -1).cos() * scale)[None, :, None], \
            (torch.cat([angles, angles], -1).sin() * scale)[None, :, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        x = _rms(h, sd[p + "attention_norm.weight"], eps)
        q = (x @ sd[p + names["q"] + ".weight"].T).view(b, s, nh, hd)
        k = (x @ sd[p + names["k"] + ".weight"].T).view(b, s, nkv, hd)
        v = (x @ sd[p + names["v"] + ".weight"].T).view(b, s, nkv, hd)
        if p + "attention.q_norm.weight" in sd:
            q, k = _rms(q, sd[p + "attention.q_norm.weight"], eps), _rms(k, sd[p + "attention.k_norm.weight"], eps)
        q, k = rope(q).transpose(1, 2), rope(k).transpose(1, 2)
        v = v.transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + att.transpose(1, 2).reshape(b, s, nh * hd) @ sd[p + "attention.wo.weight"].T
        x = _rms(h, sd[p + "ffn_norm.weight"], eps)
        mlp = F.silu(x @ sd[p + "feed_forward.w1.weight"].T) * (x @ sd[p + "feed_forward.w3.weight"].T)
        h = h + mlp @ sd[p + "feed_forward.w2.weight"].T
    return _rms(h, sd["norm.weight"], eps) @ sd[names["out"]].T


def train_hf(model, steps: int = 2, seed: int = 7):
    """``steps`` AdamW steps on the HF model; the optimizer (its state keyed by parameter)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def hf_moments(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """HF name -> the optimizer's state of that parameter (tied weights: the embedding's once)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: state for p, state in opt.state.items()}


def titan_checkpoint(model, opt=None, step: int = 2, names: dict = NEW) -> dict:
    """The state dict torchtitan's ``CheckpointManager`` hands DCP: the model's state flattened to the
    top level under torchtitan's names, and (unless model only) ``optimizer`` (its flat optimizer state
    dict: ``state.<name>.<key>``, ``param_groups.<name>.<hparam>``), ``lr_scheduler``, ``dataloader`` and
    ``train_state``."""
    config = model.config
    states: dict = titan_state(model.state_dict(), config, names)
    if opt is not None:
        table = titan_names(config.num_hidden_layers, config.model_type == "qwen3", names)
        flat = {}
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        for hf, state in hf_moments(model, opt).items():
            for key, value in state.items():
                if key in ("exp_avg", "exp_avg_sq") and config.model_type == "llama" and \
                        hf.endswith(("q_proj.weight", "k_proj.weight")):
                    value = to_pairs(value, _head_dim(config))
                flat[f"state.{table[hf]}.{key}"] = value.clone()
            for key, value in group.items():
                flat[f"param_groups.{table[hf]}.{key}"] = value
        states.update({"optimizer": flat, "lr_scheduler": {"lr_scheduler_0": {"last_epoch": step}},
                       "dataloader": {"dp_rank_0": b"\x00"}, "train_state": {"step": step, "ntokens_seen": 64 * step}})
    return states


def save_titan(out: Path, model, opt=None, step: int = 2, names: dict = NEW) -> Path:
    """``out/step-{step}``: ``titan_checkpoint`` through ``torch.distributed.checkpoint.save`` (one writer)."""
    import torch.distributed.checkpoint as dcp
    folder = out / f"step-{step}"
    dcp.save(titan_checkpoint(model, opt, step, names), checkpoint_id=str(folder), no_dist=True)
    return folder


def save_titan_sharded(rank: int, world: int, out: str) -> dict | None:
    """Rank body: torchtitan's checkpoint of a tiny Llama (2 AdamW steps, the same on every rank) as
    FSDP2 holds it, every weight and moment a DTensor sharded on dim 0 over the ranks, saved by
    ``dcp.save`` with each rank writing its shards. Rank 0 returns the HF model's state and moments."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from toolkit.families.tiny import tiny_model
    model = tiny_model("llama").train()
    opt = train_hf(model)
    mesh = init_device_mesh("cpu", (world,))

    def shard(tree):
        if isinstance(tree, dict):
            return {k: shard(v) for k, v in tree.items()}
        is_tensor = isinstance(tree, torch.Tensor) and tree.dim() > 0
        return distribute_tensor(tree, mesh, [Shard(0)]) if is_tensor else tree

    dcp.save(shard(titan_checkpoint(model, opt)), checkpoint_id=str(Path(out) / "step-2"))
    return {"model": model.state_dict(), "moments": hf_moments(model, opt)} if rank == 0 else None
