"""Mistral: Llama's table, and a sliding window over every layer where the config sets one (the
toolkit's core attention keeps keys at distance < window, as HF's mask does)."""
from toolkit.families.llama import FAMILY as LLAMA


def every_layer_window(c) -> tuple:
    """``sliding_window`` on every layer (Mistral, Phi-3), () where it is unset."""
    return (c.sliding_window,) * c.num_hidden_layers if c.sliding_window else ()


FAMILY = LLAMA.extend(model_type="mistral", windows=every_layer_window)

TINY = dict(model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=250, max_position_embeddings=64,
            sliding_window=8, tie_word_embeddings=False, pad_token_id=0)
"""The tiny test config (``toolkit/families/tiny.py``): a sliding window of 8, shorter than the parity tests' 16
tokens."""
