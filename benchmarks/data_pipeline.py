"""Data pipeline throughput: tokenize + pack through ``toolkit.data.prepare_data``, and the data wait per step.

1. Corpus. A plain-text corpus of --mb MB (default 256; --quick 16) is synthesized under a temporary
   directory (deleted at the end): one document per line, 20-300 words each, words drawn with their
   frequencies from ``toolkit/demo/corpus.txt`` (seeded), so the demo byte-level BPE sees the word
   distribution it was trained on.
2. Cold and warm preparation, each in its own process with an empty / the filled ``data.cache_dir``,
   on the demo tokenizer (vocab 2048), ``data.seq_len`` 1024, ``data.num_proc`` = --num-proc
   (default 2, the cores of this machine):
     source_s      ``load_source``: datasets' text loader, text -> Arrow (cached)
     prepare_s     ``prepare_data`` right after: tokenize (``datasets.map`` batched, num_proc
                   processes) + pack + eval split; the source is already cached, so this is the
                   tokenize + pack stage
     tokens/s      tokens of all documents (EOS included, before packing) / prepare_s, and / total
   The warm run is ``load_source`` + ``prepare_data`` on the same cache (what every rank of a
   ``toolkit train`` launch pays: the launcher checks the data, then rank 0, then the other ranks).
3. Data wait per step. The trainer builds the next global batch in a one-thread
   ``ThreadPoolExecutor`` while the current step computes, and waits on ``upcoming.result()``.
   Here that loop is reproduced with the same public functions the trainer calls
   (``global_batch_indices``, ``rank_micro_batches``, ``count_loss_tokens``) on the packed corpus,
   as DP rank 0 of 2, global batch 16, micro-batch 4, with two stand-ins for the step:
     demo model   forward + backward of the demo tiny Llama (4 layers, hidden 128) on rank 0's
                  micro-batches (real CPU work, one process: not a 2-rank job)
     none         no compute: the wait is then the full fetch time of a global batch
   Reported: the wait in ``result()`` per step (mean, p50, max, first step excluded) and the
   fetch time alone. One process; the 2-rank trainer fetches the same way on each rank.

Writes benchmarks/results/data_pipeline[_quick].json and prints a table.

  python benchmarks/data_pipeline.py [--quick] [--mb 256] [--num-proc 2] [--workdir /tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, DP = 1024, 16, 4, 2


def make_corpus(path: Path, megabytes: int, seed: int = 0) -> dict:
    import numpy as np
    text = (REPO / "toolkit" / "demo" / "corpus.txt").read_text()
    counts = Counter(text.split())
    words = np.array(list(counts), dtype=object)
    p = np.array(list(counts.values()), dtype=np.float64)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    target, written, docs = megabytes * 10**6, 0, 0
    with open(path, "w") as f:
        while written < target:
            lengths = rng.integers(20, 301, size=2000)
            ids = rng.choice(len(words), size=int(lengths.sum()), p=p)
            drawn = words[ids]
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            chunk = "".join(" ".join(drawn[a:b]) + "\n" for a, b in zip(bounds[:-1], bounds[1:]))
            f.write(chunk)
            written += len(chunk.encode())
            docs += len(lengths)
    return {"bytes": path.stat().st_size, "documents": docs}


def config(corpus: Path, cache: Path, num_proc: int):
    from toolkit.config import load_config
    return load_config(None, [f"data.path={corpus}", f"data.cache_dir={cache}", f"data.seq_len={SEQ_LEN}",
                              f"data.num_proc={num_proc}", f"train.global_batch_size={GLOBAL_BATCH}",
                              f"train.micro_batch_size={MICRO_BATCH}"])


def child_prepare(corpus: Path, cache: Path, num_proc: int) -> dict:
    """One preparation (cold or warm: decided by what is in ``cache``), in this process."""
    tic = time.perf_counter()
    from toolkit.data import load_source, load_tokenizer, prepare_data
    cfg = config(corpus, cache, num_proc)
    tok = load_tokenizer(cfg)
    import_s = time.perf_counter() - tic
    tic = time.perf_counter()
    load_source(cfg)
    source_s = time.perf_counter() - tic
    tic = time.perf_counter()
    data = prepare_data(cfg, tok)
    prepare_s = time.perf_counter() - tic
    return {"import_and_tokenizer_s": import_s, "source_s": source_s, "prepare_s": prepare_s,
            "total_s": source_s + prepare_s, "num_tokens": data.num_tokens, "num_documents": data.num_documents,
            "train_samples": len(data.train), "eval_samples": len(data.eval) if data.eval is not None else 0,
            "tokens_per_s_prepare": data.num_tokens / prepare_s,
            "tokens_per_s_total": data.num_tokens / (source_s + prepare_s),
            "peak_rss_mb_this_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_rss_mb_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def child_wait(corpus: Path, cache: Path, num_proc: int, steps: int) -> dict:
    """The trainer's prefetch loop (toolkit/train/trainer.py ``fit``) with the same data calls."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config import DEMO_DIR
    from toolkit.data import count_loss_tokens, global_batch_indices, load_tokenizer, prepare_data, rank_micro_batches
    cfg = config(corpus, cache, num_proc)
    ds = prepare_data(cfg, load_tokenizer(cfg)).train  # cached by the runs before

    def batch(step):
        t0 = time.perf_counter()
        indices = global_batch_indices(len(ds), GLOBAL_BATCH, cfg.train.seed, step)
        micro = rank_micro_batches(ds, indices, 0, DP, MICRO_BATCH)
        out = micro, count_loss_tokens(ds, indices)
        fetch_s.append(time.perf_counter() - t0)
        return out

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_DIR / "tiny-llama"))
    results = {}
    for compute in ("demo model", "none"):
        fetch_s, wait_s, compute_s = [], [], []
        with ThreadPoolExecutor(max_workers=1) as prefetch:
            upcoming = prefetch.submit(batch, 0)
            for step in range(steps):
                tic = time.perf_counter()
                micro, _ = upcoming.result()
                wait_s.append(time.perf_counter() - tic)
                if step + 1 < steps:
                    upcoming = prefetch.submit(batch, step + 1)
                tic = time.perf_counter()
                if compute == "demo model":
                    for mb in micro:
                        model(input_ids=mb["input_ids"], labels=mb["input_ids"]).loss.backward()
                compute_s.append(time.perf_counter() - tic)
        w = wait_s[1:]  # step 0 waits for the first batch with nothing to overlap
        results[compute] = {"steps": steps, "wait_ms_mean": 1e3 * statistics.mean(w),
                            "wait_ms_p50": 1e3 * statistics.median(w), "wait_ms_max": 1e3 * max(w),
                            "first_wait_ms": 1e3 * wait_s[0], "fetch_ms_mean": 1e3 * statistics.mean(fetch_s),
                            "fetch_ms_max": 1e3 * max(fetch_s), "compute_ms_mean": 1e3 * statistics.mean(compute_s),
                            "wait_share_of_step": sum(w) / (sum(w) + sum(compute_s[1:]))}
    results["train_samples"] = len(ds)
    return results


def run_child(mode: str, corpus: Path, cache: Path, num_proc: int, steps: int) -> dict:
    out = cache.parent / f"{mode}.json"
    cmd = [sys.executable, __file__, "--child", mode, "--corpus", str(corpus), "--cache", str(cache),
           "--num-proc", str(num_proc), "--steps", str(steps), "--child-out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 MB corpus (about a minute)")
    ap.add_argument("--mb", type=int, default=None, help="corpus size in MB (default 256, --quick 16)")
    ap.add_argument("--num-proc", type=int, default=2, help="data.num_proc (tokenization processes)")
    ap.add_argument("--steps", type=int, default=20, help="steps of the data-wait loop")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=["cold", "warm", "wait"], help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        corpus, cache = Path(args.corpus), Path(args.cache)
        result = (child_wait(corpus, cache, args.num_proc, args.steps) if args.child == "wait"
                  else child_prepare(corpus, cache, args.num_proc))
        Path(args.child_out).write_text(json.dumps(result))
        return 0

    mb = args.mb or (16 if args.quick else 256)
    work = Path(tempfile.mkdtemp(prefix="toolkit_bench_data-", dir=args.workdir))
    tic = time.perf_counter()
    try:
        corpus, cache = work / "corpus.txt", work / "cache"
        t0 = time.perf_counter()
        corpus_info = make_corpus(corpus, mb)
        corpus_info["generate_s"] = time.perf_counter() - t0
        print(f"corpus: {corpus_info['bytes'] / 1e6:.0f} MB, {corpus_info['documents']} documents", flush=True)
        cold = run_child("cold", corpus, cache, args.num_proc, args.steps)
        print(f"cold: {cold['total_s']:.1f} s", flush=True)
        warm = run_child("warm", corpus, cache, args.num_proc, args.steps)
        print(f"warm: {warm['total_s']:.1f} s", flush=True)
        wait = run_child("wait", corpus, cache, args.num_proc, args.steps)
        cache_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "data_pipeline", "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_at_end": os.getloadavg()},
        "versions": _versions(), "command": " ".join([sys.executable, *sys.argv]),
        "corpus": corpus_info, "cache_bytes": cache_bytes,
        "settings": {"tokenizer": "demo byte-level BPE, vocab 2048", "seq_len": SEQ_LEN, "num_proc": args.num_proc,
                     "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH, "dp": DP},
        "cold": cold, "warm": warm, "data_wait": wait, "total_wall_s": round(time.perf_counter() - tic, 1),
    }
    out = Path(args.out or REPO / "benchmarks" / "results" / f"data_pipeline{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {out}")
    return 0


def _versions() -> dict:
    from importlib.metadata import version
    return {pkg: version(pkg) for pkg in ("torch", "datasets", "tokenizers", "transformers", "pyarrow")}


def print_table(r: dict) -> None:
    c = r["corpus"]
    print(f"\ncorpus {c['bytes'] / 1e6:.0f} MB, {c['documents']} documents, {r['cold']['num_tokens'] / 1e6:.1f}M "
          f"tokens; seq_len {SEQ_LEN}, num_proc {r['settings']['num_proc']}")
    print("| run | source s | tokenize+pack s | total s | tokens/s (tokenize+pack) | tokens/s (total) |")
    print("|---|---|---|---|---|---|")
    for name in ("cold", "warm"):
        x = r[name]
        print(f"| {name} | {x['source_s']:.2f} | {x['prepare_s']:.2f} | {x['total_s']:.2f} | "
              f"{x['tokens_per_s_prepare'] / 1e6:.2f}M | {x['tokens_per_s_total'] / 1e6:.2f}M |")
    print("\n| step stand-in | compute ms/step | fetch ms/step | wait in result() ms mean / p50 / max | wait share |")
    print("|---|---|---|---|---|")
    for name in ("demo model", "none"):
        w = r["data_wait"][name]
        print(f"| {name} | {w['compute_ms_mean']:.1f} | {w['fetch_ms_mean']:.2f} | {w['wait_ms_mean']:.2f} / "
              f"{w['wait_ms_p50']:.2f} / {w['wait_ms_max']:.2f} | {100 * w['wait_share_of_step']:.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
