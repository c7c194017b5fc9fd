"""Shapes published checkpoints have and tiny test models rarely do: 9 query heads over 3 KV heads at
megatron TP=3 (a TP that divides them, not a power of two), a vocabulary divisible by neither 128
nor TP, and a tokenizer with a chat template that every hf_final/ must carry."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.megatron import GRAD_NORM_RTOL, LOSS_RTOL, losses
from tests.helpers.runs import train

pytestmark = pytest.mark.slow
VOCAB = 2053  # prime: megatron pads it to 2304 (128 x TP 3 x 6); the padded rows must never show
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
ODD_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=72, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=8, intermediate_size=96, num_hidden_layers=2,
                 vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, hidden_act="silu")


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory, data_cache):
    """A config.json and the demo BPE (trained for this vocabulary) with a chat template beside it."""
    from toolkit.data.tokenizer import _demo_tokenizer
    model_dir = tmp_path_factory.mktemp("odd_llama")
    (model_dir / "config.json").write_text(json.dumps(ODD_LLAMA))
    tok = _demo_tokenizer(VOCAB)
    tok.chat_template = CHAT
    tok.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def odd_runs(odd_model, tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("odd_runs")
    model = [f"model.name_or_path={odd_model}", "model.init=random"]
    train(root / "zero3", data_cache, *model, "zero.stage=3", nproc=2)
    train(root / "tp3", data_cache, *model, "backend=megatron", "megatron.tp=3", nproc=3)
    return root


def test_nine_heads_over_three_kv_heads_train_at_tp3_as_at_zero3(odd_runs):
    ref, got = losses(odd_runs / "zero3"), losses(odd_runs / "tp3")
    gap = max(abs(a - b) / b for a, b in zip(got, ref))
    norms, ref_norms = losses(odd_runs / "tp3", "grad_norm"), losses(odd_runs / "zero3", "grad_norm")
    print(f"\nTP3 vs ZeRO-3, 9 heads / 3 KV heads, vocab {VOCAB}: max relative loss gap {gap:.2e}, "
          f"grad norm {max(abs(a - b) / b for a, b in zip(norms, ref_norms)):.2e}")
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=LOSS_RTOL)
    assert norms == pytest.approx(ref_norms, rel=GRAD_NORM_RTOL)


@pytest.mark.parametrize("run", ["zero3", "tp3"])
def test_exports_carry_the_chat_template_and_no_padded_rows(odd_runs, run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    export = odd_runs / run / "hf_final"
    assert AutoTokenizer.from_pretrained(export).chat_template == CHAT
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert model.get_input_embeddings().weight.shape == (VOCAB, 72)
    assert model.lm_head.weight.shape == (VOCAB, 72)
    assert json.loads((export / "config.json").read_text())["vocab_size"] == VOCAB
