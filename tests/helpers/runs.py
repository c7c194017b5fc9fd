"""Run the CLI as a user does, on a tiny configuration: in a subprocess, or (``train``) in this
process with ranks forked from this process's preloaded forkserver."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Small enough for 2 cores: the demo's tiny Llama, short sequences, a few steps.
TINY = ["data.seq_len=32", "train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.warmup_steps=2", "train.eval_every=0", "checkpoint.every=100", "train.log_every=1"]


def run_cli(args: list[str], env: dict | None = None, timeout: float = 600, check: bool = True):
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"toolkit {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


RANK_PRELOAD = ["torch", "transformers.modeling_utils", "datasets", "deepspeed", "megatron.core.models.gpt",
                "megatron.core.optimizer", "toolkit.adapters.deepspeed", "toolkit.adapters.deepspeed.preload",
                "toolkit.adapters.megatron", "toolkit.data", "toolkit.train.trainer", "toolkit.train.worker",
                "tests.helpers.convert"]
"""What the forkserver of each test process imports once (``toolkit train`` without a GPU does the
same per launch, for its backend): ranks forked from it, by ``train`` or ``run_ranks``, skip ~10 s
of imports each."""


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


def worker_ranks(run_dir: Path, data_cache: Path, setup, *overrides: str, nproc: int = 1,
                 base: list[str] = TINY) -> list[int]:
    """``toolkit train``'s ranks without its launcher, each with a test's patch inside: the plan written as the
    launcher writes it, ``nproc`` ranks of the worker's own entry forked from this test process's
    forkserver, each calling ``setup(rank, run_dir)`` (a module-level function) before the worker; what
    it returns, if anything, is called once the worker finished (to write what the patch saw). The ranks'
    exit codes."""
    import multiprocessing

    from toolkit.config import load_config
    from toolkit.parallel import free_port
    from toolkit.plan import build_plan, write_plan
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [*base, f"data.cache_dir={data_cache}", f"run_dir={run_dir}", f"nproc={nproc}",
                             *overrides])
    plan_path, port = write_plan(build_plan(cfg, [nproc]), run_dir), free_port()
    start_forkserver()
    ctx = multiprocessing.get_context("forkserver")
    ranks = [ctx.Process(target=_patched_worker, args=(setup, str(plan_path), rank, nproc, port))
             for rank in range(nproc)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=600)
    return [rank.exitcode for rank in ranks]


def _patched_worker(setup, plan_path: str, rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = setup(rank, Path(plan_path).parent)
    from toolkit.train.worker import main
    code = main([plan_path])
    if done is not None:
        done()
    sys.stdout.flush()
    os._exit(code)


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
