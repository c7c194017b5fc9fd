"""Shared helpers: run the CLI as a user does, on a tiny configuration: in a subprocess, or (``train``)
in this process with ranks forked from this process's preloaded forkserver."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every rank the suite starts runs in strict device mode (toolkit/device.py): a tensor toolkit code
# leaves on the host where a GPU run needs it on the device fails the test, as NCCL would.
os.environ.setdefault("TOOLKIT_STRICT_DEVICES", "1")

# Small enough for 2 cores: the demo's tiny Llama, short sequences, a few steps.
TINY = ["data.seq_len=32", "train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.warmup_steps=2", "train.eval_every=0", "checkpoint.every=100", "train.log_every=1"]


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


def run_cli(args: list[str], env: dict | None = None, timeout: float = 600, check: bool = True):
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"toolkit {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


RANK_PRELOAD = ["torch", "transformers.modeling_utils", "datasets", "deepspeed", "megatron.core.models.gpt",
                "megatron.core.optimizer", "toolkit.adapters.deepspeed", "toolkit.adapters.megatron", "toolkit.data",
                "toolkit.train.trainer", "toolkit.train.worker", "tests.convert_helpers"]
"""What the forkserver of each test process imports once (``toolkit train`` without a GPU does the
same per launch, for its backend): ranks forked from it, by ``train`` or ``run_ranks``, skip ~10 s
of imports each."""


def megatron_engine(cfg, model, hf_state=None):
    """A ``MegatronEngine`` for this job's world size from an HF ``model`` (its config, and its weights
    unless ``hf_state`` is given), as tests that drive the engine directly build it."""
    import torch.distributed as dist

    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.plan import build_plan
    plan = build_plan(cfg, [dist.get_world_size()], hf_config=model.config)
    return MegatronEngine(plan, model.state_dict() if hf_state is None else hf_state)


def start_forkserver() -> None:
    """This test process's forkserver, started with ``RANK_PRELOAD`` (later preload lists, such as
    the launcher's, do not restart a running server)."""
    import multiprocessing
    import multiprocessing.forkserver
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def train(run_dir: Path, data_cache: Path, *overrides: str, nproc: int = 2, env: dict | None = None,
          check: bool = True, base: list[str] = TINY, isolated: bool = False):
    """``toolkit train`` on the tiny configuration. In this process by default: the launcher runs
    ``toolkit.cli.main`` here and forks ranks from this process's forkserver, so a job costs its
    training, not ~16 s of imports in a new launcher and forkserver. ``isolated=True`` runs the
    command as a user does; tests that read the ranks' own output (which goes to the forkserver's
    stdout) or signal the launcher need that."""
    args = train_args(run_dir, data_cache, *overrides, nproc=nproc, base=base)
    if isolated:
        return run_cli(args, env=env, check=check)
    return run_in_process(args, env=env, check=check)


def run_in_process(args: list[str], env: dict | None = None, timeout: float = 600, check: bool = True):
    """``toolkit.cli.main(args)`` in this process, as ``run_cli`` runs it in a subprocess: the
    environment, working directory and signal handlers are restored afterwards, the output is
    captured, an argparse exit becomes the exit code, and after ``timeout`` the command gets SIGTERM
    (a running launcher stops its ranks; before the ranks start it raises ``TimeoutError``)."""
    from toolkit.cli import main
    if args[0] == "train":
        start_forkserver()
    out, err = io.StringIO(), io.StringIO()
    expired = threading.Event()
    timer = threading.Timer(timeout, lambda: (expired.set(), os.kill(os.getpid(), signal.SIGTERM)))
    with _restored_process_state():
        os.environ.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        os.chdir(REPO)
        signal.signal(signal.SIGTERM, _timed_out)  # until torch's agent installs its own
        timer.start()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(args)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
        finally:
            timer.cancel()
    proc = subprocess.CompletedProcess(["toolkit", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        why = f"timed out after {timeout:.0f} s" if expired.is_set() else f"exited {code}"
        raise AssertionError(f"toolkit {' '.join(args)} {why} (in-process launcher)\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def _timed_out(signum, frame):
    raise TimeoutError("run_in_process: the command did not finish in time")


@contextlib.contextmanager
def _restored_process_state():
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2]
    handlers = {s: signal.getsignal(s) for s in signals}
    environ, cwd = dict(os.environ), os.getcwd()
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)


def train_args(run_dir: Path, data_cache: Path, *overrides: str, nproc: int = 2, base: list[str] = TINY) -> list[str]:
    args = ["train", "--run-dir", str(run_dir), "--nproc", str(nproc)]
    for s in [*base, f"data.cache_dir={data_cache}", *overrides]:
        args += ["--set", s]
    return args


def refused(args: list[str]) -> tuple[int, str, str]:
    """A command that must fail before anything starts, in this process (``run_in_process``, without
    a subprocess's ~8 s of imports): (exit code, stdout, stderr)."""
    proc = run_in_process(args, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def resumes(run_dir: Path) -> list[tuple[str, int, str]]:
    """(checkpoint, step, how it was loaded) of each resume recorded in ``metrics.jsonl``."""
    import json
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["checkpoint"], r["step"], r["loaded"]) for r in rows if r.get("event") == "resume"]


def losses(run_dir: Path) -> list[float]:
    from toolkit.observe.metrics import read_metrics
    return [r["loss"] for _, r in sorted(read_metrics(run_dir).items())]


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
    valid tokens (``tests/uneven_data.py``), each mode trained once per session."""
    from tests.uneven_data import UnevenRuns
    return UnevenRuns(tmp_path_factory.mktemp("uneven"), data_cache)


def _has_container_tests_and_others(nodeids: list[str]) -> bool:
    container = [n for n in nodeids if n.startswith("tests/test_container.py")]
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
        from tests import container_image
        container_image.start_background_build()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: the first worker's collection says whether the container tests will run."""
    if _has_container_tests_and_others(list(ids)):
        from tests import container_image
        container_image.start_background_build()


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
        from tests import container_image
        os.environ.setdefault(container_image.BUILD_ID_ENV, uuid.uuid4().hex)


def pytest_unconfigure(config):
    from tests import container_image
    container_image.stop_background_build()


def loss_allocations(fn, logits, labels, **kw) -> tuple[int, int]:
    """(peak live bytes, largest single allocation) of torch's CPU allocations during the loss's
    forward and backward, from the profiler's memory events (the logits themselves are allocated
    before; their gradient is among the allocations)."""
    from torch.profiler import ProfilerActivity, profile
    x = logits.detach().clone().requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss, _ = fn(x, labels, **kw)
        loss.backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, max(n for _, n in events)
