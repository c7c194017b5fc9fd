"""accelerate / HF Trainer FSDP2 checkpoints (``checkpoint-N/pytorch_model_fsdp_0/``, ``optimizer_0/``,
``trainer_state.json``) as a converter source and as ``--to accelerate`` (issue 32).

The checkpoint is written by accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` (its
FSDP2 plugin, torch DCP underneath) from a ``fully_shard`` model on 2 gloo ranks; HF Trainer and a
real ``Accelerator`` cannot run FSDP on CPU (tests/helpers/dcp.py ``accelerate_state`` says why).
The proof of ``--to accelerate`` is accelerate's own ``load_fsdp_model`` / ``load_fsdp_optimizer`` at
another world size: the state it loads is the source's bit for bit, and training on gives the
source run's own next losses."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.dcp import NEXT, STEPS, build_accelerate_checkpoint, resume_accelerate
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import run_cli
from toolkit.convert.inspect import inspect
from toolkit.convert.run import convert
from toolkit.formats.detect import locate, open_source
from toolkit.formats.errors import ConvertError

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]
REL = 1e-6
"""fp32 rounding (the resumed run is on 1 rank, the source on 2: reductions in another order)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return build_accelerate_checkpoint(tmp_path_factory.mktemp("accelerate"))


def test_detected_inspected_and_read_exactly(saved):
    ckpt, reference = saved
    assert locate(ckpt).format == "accelerate"
    described = inspect(ckpt)
    assert (described["format"], described["layout"], described["step"]) == ("accelerate", {"dp": 2}, STEPS)
    assert "accelerate" in run_cli(["inspect", str(ckpt)]).stdout
    source = open_source(ckpt)
    assert sorted(source.names()) == sorted(reference["model"])
    state = reference["optim"]["state"]
    for name in source.names():
        assert torch.equal(source.read(name), reference["model"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(source.read(name, key), state[name][key]), (name, key)


def test_to_accelerate_resumes_in_accelerates_own_loader_at_another_world_size(saved, tmp_path):
    """accelerate (2 ranks) -> ZeRO -> accelerate -> accelerate's load_fsdp_model / load_fsdp_optimizer
    on 1 rank; a weights-only conversion (fresh Adam) must miss the second loss."""
    ckpt, reference = saved
    convert(ckpt, tmp_path / "zero", to="zero")
    out = tmp_path / "trainer" / f"checkpoint-{STEPS}"
    run_cli(["convert", str(tmp_path / "zero"), str(out), "--to", "accelerate"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == STEPS
    assert torch.load(out / "scheduler.pt", weights_only=True)["last_epoch"] == STEPS
    resumed = run_ranks(resume_accelerate, 1, tmp_path, "llama", str(out))[0]
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    for name, state in reference["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed["optim"]["state"][name][key], state[key]), (name, key)
    assert len(resumed["losses"]) == NEXT
    assert resumed["losses"] == pytest.approx(reference["losses"], rel=REL)
    convert(ckpt, tmp_path / "weights_only", to="accelerate", weights_only=True)
    fresh = run_ranks(resume_accelerate, 1, tmp_path, "llama", str(tmp_path / "weights_only"))[0]["losses"]
    assert fresh[0] == pytest.approx(reference["losses"][0], rel=REL)
    assert fresh[1] != pytest.approx(reference["losses"][1], rel=REL), "a fresh Adam matched: moments unseen"


def test_a_missing_optimizer_shard_is_refused(saved, tmp_path):
    ckpt, _ = saved
    copy = tmp_path / "output" / ckpt.name
    shutil.copytree(ckpt.parent, copy.parent)
    (copy / "optimizer_0" / "__1_0.distcp").unlink()
    with pytest.raises(ConvertError, match=r"optimizer_0: data files \['__1_0.distcp'\] named in .metadata are missing"):
        open_source(copy)
