"""``toolkit train`` with ``zero.offload_activations=true`` (ZeRO-3, activation checkpointing, 2 ranks):
the key reaches the ranks through plan.json and the run's losses and grad norms equal the same run
with it off, step for step, bit for bit (the copy to the host and back changes no value)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.runs import train
from toolkit.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

RUN = ["train.steps=3", "zero.stage=3", "model.activation_checkpointing=true"]


def test_offloaded_run_trains_as_the_run_on_the_device(tmp_path, data_cache):
    got = {}
    for offload in (False, True):
        run_dir = tmp_path / f"offload_{offload}"
        train(run_dir, data_cache, *RUN, f"zero.offload_activations={str(offload).lower()}")
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["config"]["zero"]["offload_activations"] is offload
        got[offload] = [(r["loss"], r["grad_norm"]) for _, r in sorted(read_metrics(run_dir).items())]
    assert len(got[True]) == 3 and got[True] == got[False], got
