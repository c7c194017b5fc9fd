"""Mistral: Llama's table; sliding-window attention is not available in the megatron path."""
from toolkit.families.base import Check
from toolkit.families.llama import FAMILY as LLAMA

FAMILY = LLAMA.extend(
    model_type="mistral",
    checks=(Check("sliding_window", lambda v: v is not None,
                  "set \"sliding_window\": null in config.json (identical while sequences are no longer than "
                  "the window) or use backend=deepspeed"),),
)
