"""Fixtures and hooks for the whole suite (pytest finds them; nothing imports this module). What tests
share besides fixtures lives in tests/helpers/."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import train

# Every rank the suite starts runs in strict device mode (toolkit/device.py): a tensor toolkit code
# leaves on the host where a GPU run needs it on the device fails the test, as NCCL would.
os.environ.setdefault("TOOLKIT_STRICT_DEVICES", "1")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenized-data cache for the whole session (the demo corpus is tokenized once)."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def demo_base(tmp_path_factory) -> Path:
    """The demo's tiny Llama with HF's init (seed 0), saved as a pretrained base (LoRA runs adapt it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config import DEMO_DIR
    path = tmp_path_factory.mktemp("lora_demo_base") / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_DIR / "tiny-llama")).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def runs(tmp_path_factory, data_cache):
    """Runs by name, each trained once per session and shared by the tests that compare them."""
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("runs")

    def get(name: str, *overrides: str, nproc: int = 2) -> Path:
        if name not in cache:
            run_dir = root / name
            train(run_dir, data_cache, "checkpoint.every=3", *overrides, nproc=nproc)
            cache[name] = run_dir
        return cache[name]
    return get


@pytest.fixture(scope="session")
def uneven_runs(tmp_path_factory, data_cache):
    """Runs on instruction data whose micro-batches and DP ranks hold very different numbers of
    valid tokens (``tests/helpers/uneven_data.py``), each mode trained once per session."""
    from tests.helpers.uneven_data import UnevenRuns
    return UnevenRuns(tmp_path_factory.mktemp("uneven"), data_cache)


def _has_container_tests_and_others(nodeids: list[str]) -> bool:
    container = [n for n in nodeids if n.startswith("tests/e2e/test_container.py")]
    return 0 < len(container) < len(nodeids)


def pytest_collection_modifyitems(config, items):
    """GPU tests only with ``-m gpu`` (never in a plain run, so never on CI); container tests run
    last, their image building in the background from the start."""
    if "gpu" not in (config.option.markexpr or ""):
        gpu = [item for item in items if item.get_closest_marker("gpu")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    container = [item for item in items if item.get_closest_marker("container")]
    if not container:
        return
    items[:] = [item for item in items if not item.get_closest_marker("container")] + container
    in_worker = hasattr(config, "workerinput")  # under xdist the controller starts it (hook below)
    if not in_worker and not config.option.collectonly and _has_container_tests_and_others(
            [item.nodeid for item in items]):  # overlap the build with the rest
        from tests.helpers import container_image
        container_image.start_background_build()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: the first worker's collection says whether the container tests will run."""
    if _has_container_tests_and_others(list(ids)):
        from tests.helpers import container_image
        container_image.start_background_build()


def pytest_addoption(parser):
    from tests.helpers.goldens import RECORD_OPTION
    parser.addoption(RECORD_OPTION, action="store_true",
                     help="write the loss goldens (tests/assets/loss_goldens) from this run instead of comparing")


def pytest_configure(config):
    """The venv's bin first on PATH for every process the tests start, as for a user who activated
    it. DeepSpeed JIT-builds its CPU ops with whichever ``ninja`` PATH finds; the venv's (1.13, a
    deepspeed dependency) and a system ninja (1.11) hash build commands differently, so a suite that
    mixed them (the Slurm examples put the venv first) rebuilt every op, 1-2 minutes, at each switch.
    Likewise one folder of built ops per environment (``toolkit/compat/torch_extensions.py``).

    And the container build's id, shared through the environment with the xdist workers that the
    controller starts after this."""
    venv_bin = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != venv_bin:
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    from toolkit.compat import torch_extensions
    torch_extensions.install()  # every process of the suite, DeepSpeed's own ops tests too: one build
    if not hasattr(config, "workerinput"):
        import uuid

        from tests.helpers import container_image
        os.environ.setdefault(container_image.BUILD_ID_ENV, uuid.uuid4().hex)


def pytest_unconfigure(config):
    from tests.helpers import container_image
    container_image.stop_background_build()


def pytest_terminal_summary(terminalreporter):
    """Each tier's time (tests/unit, distributed, e2e, ...): tests run and the seconds they took,
    setup and teardown included (summed over the xdist workers: on 2 workers about twice the wall)."""
    tiers: dict[str, list[float]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid, when = getattr(report, "nodeid", ""), getattr(report, "when", None)
            if not nodeid.startswith("tests/") or when is None:
                continue
            tier = tiers.setdefault(nodeid.split("/")[1], [0, 0.0])
            tier[0] += when == "call"
            tier[1] += getattr(report, "duration", 0.0)
    if tiers:
        terminalreporter.section("time per tier")
        for name, (count, seconds) in sorted(tiers.items()):
            minutes = f"{seconds / 60:.1f} min, summed over workers"
            terminalreporter.write_line(f"{name:12} {count:5d} tests {seconds:8.0f} s ({minutes})")


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory) -> dict:
    """Tiny random Qwen2.5-VL, Qwen2-VL and LLaVA directories with their processors (``examples/vlm/build.py``),
    and 64 image-text rows (``examples/vlm/data.py``): ``{"qwen2_5_vl": dir, "qwen2_vl": dir, "llava": dir,
    "rows": train.jsonl}``."""
    import warnings

    from tests.helpers.vlm import build_models, write_rows
    root = tmp_path_factory.mktemp("tiny_vlms")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {**build_models(root), "rows": write_rows(root / "data", 64)}
