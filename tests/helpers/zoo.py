"""The config zoo: tiny HF configs with the variants published checkpoints have, and which feature
test meets which variant (``tests/test_zoo_*.py``).

Each variant is one family's tiny config (``toolkit/families/tiny.py``) cut to 2 layers and changed
along the axes real checkpoints vary on, where HF's config class for the family allows it: tied or
untied embeddings, attention biases, ``head_dim`` apart from hidden / heads, one KV head
(multi-query attention), a vocabulary that is not a multiple of 64 (and one that is), RoPE scaling
(llama3, linear, yarn). ``axes()`` reads each of these from the built HF config itself, so a label
cannot claim an axis the config does not have.

``MATRIX`` is the covering assignment: every variant meets every feature once, each cell saying how
(the stage, layout or conversion path, rotated over the variants so that each of those is met too),
or ``refused`` where the toolkit refuses the combination before anything starts (the cell's test
then asserts the refusal and its message). ``tests/unit/test_zoo_matrix.py`` checks the matrix is
complete and that every axis value is met by every feature.
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.families.tiny import tiny_config, tiny_model

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "factor": 2.0}
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}


@dataclass(frozen=True)
class Variant:
    family: str
    changes: dict
    why: str

    def config(self):
        return tiny_config(self.family, **self.layers(), **self.changes)

    def model(self, seed: int = 0):
        return tiny_model(self.family, seed=seed, **self.layers(), **self.changes)

    def layers(self) -> dict:
        key = "n_layer" if self.family == "gpt2" else "num_hidden_layers"
        extra = {"layer_types": ["sliding_attention", "full_attention"]} if self.family == "gemma2" else {}
        return {key: 2, **extra}


VARIANTS = {
    "llama-tied-llama3": Variant("llama", dict(tie_word_embeddings=True, rope_scaling=LLAMA3, vocab_size=250),
                                 "small published Llamas (Llama 3.2 1B): tied, llama3 RoPE"),
    "llama-mqa-linear-hd": Variant("llama", dict(num_key_value_heads=1, head_dim=24, rope_scaling=LINEAR,
                                                 vocab_size=256), "one KV head, head_dim 24 != 64/4, linear "
                                                                  "RoPE, a vocabulary of 4 x 64"),
    "llama-bias-yarn": Variant("llama", dict(attention_bias=True, rope_scaling=YARN, vocab_size=251),
                               "q/k/v/o biases and yarn: DeepSpeed only (the megatron table refuses both)"),
    "mistral-mqa-linear": Variant("mistral", dict(num_key_value_heads=1, rope_scaling=LINEAR, vocab_size=263),
                                  "one KV head, linear RoPE, sliding window 8"),
    "mixtral-tied-hd": Variant("mixtral", dict(tie_word_embeddings=True, head_dim=32, vocab_size=250),
                               "MoE, tied, head_dim 32"),
    "qwen2-untied-linear": Variant("qwen2", dict(tie_word_embeddings=False, rope_scaling=LINEAR, vocab_size=301),
                                   "q/k/v biases, untied (Qwen2 7B), linear RoPE"),
    "qwen2-tied-mqa": Variant("qwen2", dict(num_key_value_heads=1, vocab_size=250),
                              "q/k/v biases, tied (Qwen2 0.5B), one KV head"),
    "qwen2_moe-tied": Variant("qwen2_moe", dict(vocab_size=250), "MoE with q/k/v biases and a shared expert, tied"),
    "qwen3-tied-hd-mqa": Variant("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=1, vocab_size=250),
                                 "tied (Qwen3 0.6B), head_dim 32, one KV head"),
    "qwen3_moe-hd": Variant("qwen3_moe", dict(vocab_size=250), "MoE, q/k norms, head_dim 32"),
    "gemma-mqa-hd": Variant("gemma", dict(num_key_value_heads=1, vocab_size=250),
                            "one KV head and head_dim 32 (Gemma 2B), tied"),
    "gemma2-tied-hd": Variant("gemma2", dict(vocab_size=250), "softcaps, post-norms, head_dim 32, tied"),
    "olmo2-untied": Variant("olmo2", dict(vocab_size=250), "no pre-norms: post-norms and q/k norms over all "
                                                           "heads' width, untied"),
    "gpt2-tied": Variant("gpt2", dict(vocab_size=259), "biases everywhere, learned positions, tied"),
    "phi3-untied-mqa-hd": Variant("phi3", dict(num_key_value_heads=1, head_dim=24, vocab_size=250),
                               "packed qkv/gate_up, one KV head, head_dim 24 != 64/4, sliding window 6"),
}

FEATURES = ("lora_deepspeed", "lora_megatron", "convert", "lora_convert", "resume", "packing", "export")

# How each variant meets each feature. lora_deepspeed: ZeRO stage of the LoRA engine (2 ranks);
# lora_megatron: layout (2 ranks; one KV head cannot split over TP, MoE under TP needs SP);
# convert: the path through the formats (h = HF, zS = ZeRO stage S at DP 2, mTP = megatron at tp, pp),
# each hop verified (every direction between the three formats is met, tp 2 and pp 2 too);
# lora_convert: the LoRA ZeRO checkpoint of the lora_deepspeed cell along a path (z = ZeRO DP 2 stage 2,
# mTP = megatron, p = an HF-PEFT directory), each hop `toolkit convert --verify`;
# resume: full fine-tuning saved at one ZeRO stage, resumed at another (DP 2) through a universal
# checkpoint; packing: documents packed in rows (toolkit's document attention in HF's model);
# export: which engine writes hf_final/ (lora-zero, lora-megatron: the merge; zero: full weights).
MATRIX_TEXT = """
variant               lora_deepspeed  lora_megatron  convert       lora_convert  resume   packing    export
llama-tied-llama3     zero3           tp2            h>z3>m12>h    z>m21>p       z2>z3    documents  lora-megatron
llama-mqa-linear-hd   zero2           pp2            h>m12>z1>h    z>m12>z>p     z3>z1    documents  zero
llama-bias-yarn       zero3           refused        h>z2>h        z>p           z1>z3    documents  lora-zero
mistral-mqa-linear    zero2           pp2            h>m12>z2>h    z>m12>p       z3>z2    documents  lora-megatron
mixtral-tied-hd       zero3           tp2_sp         h>z3>m21>h    z>m12>z>p     z2>z1    documents  zero
qwen2-untied-linear   zero2           tp2            h>m21>z1>h    z>m21>z>p     z1>z2    documents  lora-zero
qwen2-tied-mqa        zero3           pp2            h>z2>m12>h    z>m12>p       z2>z3    documents  lora-megatron
qwen2_moe-tied        zero2           pp2            h>m12>z3>h    z>m12>p       z3>z1    documents  zero
qwen3-tied-hd-mqa     zero3           pp2            h>z1>m12>h    z>m12>z>p     z1>z2    documents  lora-zero
qwen3_moe-hd          zero2           tp2_sp         h>m21>z2>h    z>p>m12>p     z2>z3    documents  lora-megatron
gemma-mqa-hd          zero3           pp2            h>z3>m12>h    z>m12>p       z3>z2    documents  zero
gemma2-tied-hd        zero2           pp2            h>m21>z1>h    z>p           z1>z3    documents  lora-zero
olmo2-untied          zero3           tp2            h>z2>m21>h    z>m21>p       z2>z1    documents  lora-megatron
gpt2-tied             zero3           tp2            h>z2>m21>h    z>m21>z>p     z2>z1    documents  zero
phi3-untied-mqa-hd    zero2           pp2            h>m12>z3>h    z>p>m12>p     z3>z2    documents  lora-megatron
"""

REFUSALS = {  # (variant, feature): what the refusal must name
    ("llama-bias-yarn", "lora_megatron"): "attention_bias",
}
"""Cells the toolkit refuses before anything starts, and the words its message must hold."""


def parse_matrix(text: str = MATRIX_TEXT) -> dict[str, dict[str, str]]:
    lines = [line.split() for line in text.strip().splitlines()]
    header, rows = lines[0], lines[1:]
    return {row[0]: dict(zip(header[1:], row[1:])) for row in rows}


MATRIX = parse_matrix()


def cells(feature: str) -> dict[str, str]:
    """variant -> setting for one feature (refused cells included)."""
    return {v: row[feature] for v, row in MATRIX.items()}


def runs(feature: str) -> dict[str, str]:
    """variant -> setting for one feature, refused cells left out."""
    return {v: s for v, s in cells(feature).items() if s != "refused"}


def convert_path(setting: str) -> list[tuple[str, dict]]:
    """``h>z3>m21>h`` -> [("hf", {}), ("zero", {"dp": 2, "zero_stage": 3}), ("megatron", {"tp": 2, "pp": 1}),
    ("hf", {})]."""
    out = []
    for hop in setting.split(">"):
        if hop == "h":
            out.append(("hf", {}))
        elif hop[0] == "z":
            out.append(("zero", {"dp": 2, "zero_stage": int(hop[1])}))
        else:
            out.append(("megatron", {"tp": int(hop[1]), "pp": int(hop[2])}))
    return out


def lora_convert_path(setting: str) -> list[tuple[str, list[str]]]:
    """``z>m21>p`` -> [("zero", [...]), ("megatron", ["--tp", "2", "--pp", "1"]), ("peft", [])]: each hop's
    ``toolkit convert`` arguments (the first is the source, the run's own checkpoint)."""
    out = []
    for hop in setting.split(">"):
        if hop == "p":
            out.append(("peft", []))
        elif hop == "z":
            out.append(("zero", ["--dp", "2", "--zero-stage", "2"]))
        else:
            out.append(("megatron", ["--tp", hop[1], "--pp", hop[2]]))
    return out


def axes(variant: str) -> set[str]:
    """The axis values a variant's built HF config really has."""
    from toolkit.families import attention_dims, rope_parameters
    cfg = VARIANTS[variant].config()
    heads, kv_heads, head_dim = attention_dims(cfg)
    hidden = cfg.hidden_size
    model = VARIANTS[variant].model()
    biased = any(n.endswith(("q_proj.bias", "c_attn.bias", "qkv_proj.bias")) for n, _ in model.named_parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    positions = "learned-positions" if cfg.model_type == "gpt2" else "rope:" + rope_parameters(cfg)["rope_type"]
    return {"tied" if tied else "untied", "bias" if biased else "no-bias",
            "head_dim!=hidden/heads" if head_dim != hidden // heads else "head_dim=hidden/heads",
            "one-kv-head" if kv_heads == 1 else "gqa-or-mha",
            "vocab%64!=0" if cfg.vocab_size % 64 else "vocab%64==0", positions}


AXES = {"tied", "untied", "bias", "no-bias", "head_dim!=hidden/heads", "one-kv-head", "vocab%64!=0", "vocab%64==0",
        "rope:llama3", "rope:linear", "rope:yarn"}
"""Every axis value the zoo must hold (each feature must meet each of them too)."""


def selected(request, table: dict) -> dict:
    """The part of ``table`` (variant -> setting) that the selected tests using the requesting
    fixture ask for (``-k olmo2`` builds the olmo2 variant only); all of it when one of those tests
    is not parametrized by variant."""
    wanted = set()
    for item in request.session.items:
        if item.module is not request.module or request.fixturename not in item.fixturenames:
            continue
        variant = getattr(item, "callspec", None) and item.callspec.params.get("variant")
        if variant is None:
            return table
        wanted.add(variant)
    return {v: s for v, s in table.items() if v in wanted}


def save_base(variant: str, root) -> str:
    """The variant's seeded model saved as a pretrained base (LoRA runs adapt it)."""
    path = root / variant
    if not path.exists():
        VARIANTS[variant].model().save_pretrained(path)
    return str(path)


def run_zoo_ranks(request, tmp_path_factory, name: str, table: dict, rank_fn):
    """The selected variants of ``table`` saved as bases once, then ``rank_fn(rank, world, bases, root)``
    on 2 gloo ranks: (each rank's result, the bases, the root)."""
    from tests.helpers.ranks import run_ranks
    root = tmp_path_factory.mktemp(name)
    bases = {v: save_base(v, root / "bases") for v in selected(request, table)}
    ranks = run_ranks(rank_fn, 2, tmp_path_factory.mktemp(f"{name}_ranks"), bases, str(root), timeout=1200)
    return ranks, bases, root


def batches(vocab: int, n_micro: int = 4, seq: int = 16, seed: int = 3):
    from tests.helpers.parity import batches as parity_batches
    return parity_batches(vocab, n_micro=n_micro, seq=seq, seed=seed)

