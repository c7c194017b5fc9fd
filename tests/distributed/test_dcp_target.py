"""``convert --to dcp``: a PyTorch distributed checkpoint of an FSDP2 model (issue 32).

The proof is PyTorch's own loader: a plain FSDP2 loop (``fully_shard``, ``torch.optim.AdamW``) at
another world size than the source run ``dcp.load``s the output and ``set_model_state_dict`` /
``set_optimizer_state_dict``s it, then trains on: its losses equal the source run's own next losses
(DeepSpeed ZeRO-2 on 2 ranks -> FSDP2 on 1; the toolkit's megatron-core engine at TP 2 -> FSDP2 on 2).
The same loop from a ``--weights-only`` conversion (fresh Adam) leaves the second step's loss off:
the comparison sees the moments. And FSDP2's own DCP -> ZeRO -> DCP gives back every tensor bit for bit."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dcp import (
    NEXT,
    build_fsdp2_dcp,
    fsdp2_resume,
    megatron_batches,
    megatron_run,
    zero2_batches,
    zero2_run,
)
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import run_cli
from toolkit.convert.run import convert
from toolkit.formats.dcp_metadata import load_metadata
from toolkit.formats.detect import open_source

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

K = 2  # the source checkpoint's step
ZERO_HPARAMS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # tests.helpers.convert
MEGATRON_HPARAMS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # the toolkit's defaults
REL = 1e-5
"""fp32 rounding: the FSDP2 loop sums the same terms in another order than DeepSpeed / megatron-core."""


def _resume(tmp_path: Path, dcp_dir: Path, world: int, steps, hparams: dict, family: str = "llama") -> dict:
    return run_ranks(fsdp2_resume, world, tmp_path, family, str(dcp_dir), steps, hparams)[0]


def test_zero2_run_resumes_in_plain_fsdp2_at_another_world_size(tmp_path):
    from toolkit.families.tiny import tiny_config
    ckpt = tmp_path / "zero2"
    per_rank = run_ranks(zero2_run, 2, tmp_path, str(ckpt), K)
    source = [sum(losses) / 2 for losses in zip(*per_rank)]  # DeepSpeed's loss of the global batch
    run_cli(["convert", str(ckpt), str(tmp_path / "dcp"), "--to", "dcp"])
    convert(ckpt, tmp_path / "dcp_weights", to="dcp", weights_only=True)
    steps = zero2_batches(2, tiny_config("llama").vocab_size, K)
    resumed = _resume(tmp_path, tmp_path / "dcp", 1, steps, ZERO_HPARAMS)
    assert resumed["step"] == [float(K)] and [g["weight_decay"] for g in resumed["groups"]] == [0.1, 0.0]
    assert len(resumed["losses"]) == NEXT
    assert resumed["losses"] == pytest.approx(source, rel=REL), (resumed["losses"], source)
    fresh = _resume(tmp_path, tmp_path / "dcp_weights", 1, steps, ZERO_HPARAMS)["losses"]
    assert fresh[0] == pytest.approx(source[0], rel=REL)  # the weights alone give the first step
    assert fresh[1] != pytest.approx(source[1], rel=REL), "a fresh Adam matched: the test cannot see the moments"


def test_megatron_tp2_run_resumes_in_plain_fsdp2_on_two_ranks(tmp_path):
    from toolkit.families.tiny import tiny_config
    config = tiny_config("llama")
    ckpt = tmp_path / "meg"
    source = run_ranks(megatron_run, 2, tmp_path, "llama", str(ckpt), K)[0]
    config.to_json_file(tmp_path / "config.json")
    _no_decay_group_first(ckpt)
    written = [g["weight_decay"] for g in open_source(ckpt, str(tmp_path / "config.json")).param_groups]
    assert written == [0.0, 0.1], written  # the source's first group is not the matrices' rate
    convert(ckpt, tmp_path / "dcp", to="dcp", hf_config=str(tmp_path / "config.json"))
    resumed = _resume(tmp_path, tmp_path / "dcp", 2, megatron_batches(config.vocab_size, K), MEGATRON_HPARAMS)
    assert resumed["step"] == [float(K)]
    # every written group's decay, as PyTorch's own loader sets it: the matrices 0.1, biases and norms 0
    # (the losses alone cannot tell: a lost decay moved them by 3.3e-7 over two steps)
    assert [g["weight_decay"] for g in resumed["groups"]] == [0.1, 0.0], resumed["groups"]
    assert resumed["losses"] == pytest.approx(source, rel=REL), (resumed["losses"], source)
    # through ZeRO's universal layout, whose description keeps one rate: the matrices'
    convert(ckpt, tmp_path / "zero", to="zero", hf_config=str(tmp_path / "config.json"))
    convert(tmp_path / "zero", tmp_path / "dcp_via_zero", to="dcp")
    assert open_source(tmp_path / "dcp_via_zero").optimizer_hparams["weight_decay"] == 0.1


def _no_decay_group_first(ckpt: Path) -> None:
    """The torch_dist checkpoint's optimizer groups (common.pt, which this test's run just wrote) in the
    other order: megatron-core orders its groups by their settings (decay, lr multipliers, expert or not),
    so a converter may not take the first group's decay as the matrices'."""
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["optimizer"]["optimizer"]["param_groups"].reverse()
    torch.save(common, ckpt / "common.pt")


def test_fsdp2_dcp_to_zero_and_back_is_bit_for_bit(tmp_path):
    """qwen2: tied embeddings (the model state holds lm_head.weight too, the optimizer state does not)."""
    ckpt, config, _ = build_fsdp2_dcp(tmp_path, "qwen2")
    convert(ckpt, tmp_path / "zero", to="zero", hf_config=str(config))
    convert(tmp_path / "zero", tmp_path / "back", to="dcp")
    original, back = load_metadata(ckpt).state_dict_metadata, load_metadata(tmp_path / "back").state_dict_metadata
    tensors = sorted(k for k, v in original.items() if hasattr(v, "size"))
    assert tensors == sorted(k for k, v in back.items() if hasattr(v, "size"))
    a, b = open_source(ckpt, str(config)), open_source(tmp_path / "back")
    assert (a.step, a.optimizer_hparams) == (b.step, b.optimizer_hparams)
    for name in a.names():
        for state in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.read(name, state), b.read(name, state)), (name, state)
    assert torch.equal(b._model.tensor("model.lm_head.weight"), a.read("model.embed_tokens.weight"))
