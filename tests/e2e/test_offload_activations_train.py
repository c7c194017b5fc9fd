"""A training run with ``zero.offload_activations=true`` (ZeRO-3, activation checkpointing, 2 ranks): the key
reaches the ranks through plan.json, the ranks' checkpointed layers hand their inputs to torch's
``save_on_cpu`` (counted inside each rank: on the CPU the "copy" to the host moves nothing, so equal losses
alone would not show that the offload ran), and the run's losses and grad norms equal the same run with it
off, step for step, bit for bit. The ranks are the worker's own entry, started without the launcher
(``tests/helpers/runs.py::worker_ranks``) so that the count runs inside them."""
from __future__ import annotations

import json

import pytest

from tests.helpers.offload import expected_bytes
from tests.helpers.runs import worker_ranks
from toolkit.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = 3
RUN = [f"train.steps={STEPS}", "zero.stage=3", "model.activation_checkpointing=true"]


def _count_host_saves(rank, run_dir):
    """A rank's setup: count what ``save_on_cpu`` packs, written to ``host_saves_rank<R>.json`` at the end."""
    from tests.helpers.offload import host_saves
    counting = host_saves()
    seen = counting.__enter__()

    def done() -> None:  # holds the patch until the worker finished (a dropped context manager undoes it)
        counting.__exit__(None, None, None)
        record = {"tensors": len(seen), "bytes": sum(nbytes for *_, nbytes in seen)}
        (run_dir / f"host_saves_rank{rank}.json").write_text(json.dumps(record))
    return done


def test_offloaded_run_trains_as_the_run_on_the_device(tmp_path, data_cache):
    from toolkit.plan import read_plan
    got, saved = {}, {}
    for offload in (False, True):
        run_dir = tmp_path / f"offload_{offload}"
        assert worker_ranks(run_dir, data_cache, _count_host_saves, *RUN,
                            f"zero.offload_activations={str(offload).lower()}", nproc=2) == [0, 0]
        plan = read_plan(run_dir / "plan.json")
        assert plan.config.zero.offload_activations is offload
        got[offload] = [(r["loss"], r["grad_norm"]) for _, r in sorted(read_metrics(run_dir).items())]
        saved[offload] = [json.loads((run_dir / f"host_saves_rank{r}.json").read_text()) for r in (0, 1)]
    cfg = plan.config
    micro_batches = STEPS * cfg.train.global_batch_size // (2 * cfg.train.micro_batch_size)  # per rank
    want = expected_bytes(cfg, plan.model.hf_config(), micro_batches)
    print(f"\nsaved on the host per rank: {saved}, expected {want} bytes each")
    assert saved[False] == [{"tensors": 0, "bytes": 0}] * 2
    assert [s["bytes"] for s in saved[True]] == [want] * 2  # every checkpointed layer's input, each micro-batch
    assert len(got[True]) == STEPS and got[True] == got[False], got
