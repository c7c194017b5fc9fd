"""Mistral: Llama's table, and a sliding window over every layer where the config sets one (the
toolkit's core attention keeps keys at distance < window, as HF's mask does)."""
from toolkit.families.llama import FAMILY as LLAMA


def every_layer_window(c) -> tuple:
    """``sliding_window`` on every layer (Mistral, Phi-3), () where it is unset."""
    return (c.sliding_window,) * c.num_hidden_layers if c.sliding_window else ()


FAMILY = LLAMA.extend(model_type="mistral", windows=every_layer_window)
