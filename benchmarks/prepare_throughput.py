"""``toolkit prepare`` (text -> Megatron indexed dataset, streamed) beside today's ``datasets.map`` tokenize path.

1. Corpus: plain text of --small and --large MB (default 40 and 160), one document per line, 20-300 words
   drawn with the demo corpus's word frequencies (``benchmarks/data_pipeline.py::make_corpus``), in a
   temporary directory deleted at the end.
2. For each corpus, each command in its own process, cold caches, ``data.num_proc`` = --num-proc (2):
     prepare   ``python -m toolkit prepare --out PREFIX`` (the CLI as users run it)
     map       ``load_source`` + the pipeline's tokenize stage (``datasets.map`` batched over num_proc
               processes, written to the Arrow cache), what ``toolkit train`` does before packing
   Peak memory: the sum of the RSS of the command's process and all its children, sampled every 50 ms
   (psutil), so the tokenizing workers count; tokens/s: the document tokens (EOS included) over the
   command's wall time (imports and start of workers included, both sides).
3. Acceptance (issue #44): prepare's peak at the large corpus within 1.25x of the small one's, under
   1.5 GB.

Writes benchmarks/results/prepare_throughput.json and prints a table.

  python benchmarks/prepare_throughput.py [--small 40] [--large 160] [--num-proc 2] [--workdir /tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from data_pipeline import make_corpus  # noqa: E402

MAP_CHILD = """
import sys, time, json
from toolkit.config import load_config
from toolkit.data import load_source, load_tokenizer
from toolkit.data.pack import _tokenize
cfg = load_config(None, [f"data.path={sys.argv[1]}", f"data.cache_dir={sys.argv[2]}", f"data.num_proc={sys.argv[3]}"])
source = load_source(cfg)
docs = _tokenize(source, cfg, load_tokenizer(cfg))
import pyarrow.compute as pc
print(json.dumps({"tokens": int(pc.sum(pc.list_value_length(docs.data.column("ids"))).as_py()), "documents": len(docs)}))
"""


def measured(command: list[str], env: dict) -> dict:
    """Wall time, peak RSS of the process tree (MB) and the last stdout line of ``command``."""
    tic = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{command} exited {proc.returncode}:\n{err[-3000:]}")
    return {"wall_s": round(time.perf_counter() - tic, 2), "peak_rss_mb": round(peak / 2**20, 1),
            "stdout": out.strip().splitlines()[-1] if out.strip() else ""}


def run(corpus: Path, work: Path, num_proc: int, env: dict) -> dict:
    out = work / f"{corpus.stem}-prefix"
    prepare = measured([sys.executable, "-m", "toolkit", "prepare", "--set", f"data.path={corpus}",
                        "--set", f"data.num_proc={num_proc}", "--set", f"data.cache_dir={work / 'cache-prepare'}",
                        "--out", str(out)], env)
    meta = json.loads(Path(str(out) + ".json").read_text())
    prepare.update(tokens=meta["tokens"], documents=meta["documents"], tokens_per_s=round(meta["tokens"] / prepare["wall_s"]),
                   prefix_bytes=os.path.getsize(str(out) + ".bin") + os.path.getsize(str(out) + ".idx"))
    mapped = measured([sys.executable, "-c", MAP_CHILD, str(corpus), str(work / f"cache-map-{corpus.stem}"),
                       str(num_proc)], env)
    counts = json.loads(mapped.pop("stdout"))
    mapped.update(counts, tokens_per_s=round(counts["tokens"] / mapped["wall_s"]))
    prepare.pop("stdout")
    assert counts["tokens"] == meta["tokens"] and counts["documents"] == meta["documents"], (counts, meta)
    for f in work.glob(f"{corpus.stem}-prefix*"):
        f.unlink()
    shutil.rmtree(work / f"cache-map-{corpus.stem}", ignore_errors=True)
    return {"corpus_bytes": corpus.stat().st_size, "prepare": prepare, "datasets_map": mapped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=40)
    ap.add_argument("--large", type=int, default=160)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    work = Path(tempfile.mkdtemp(prefix="prepare-bench-", dir=args.workdir))
    results = {}
    try:
        for mb in (args.small, args.large):
            corpus = work / f"corpus{mb}.txt"
            make_corpus(corpus, mb)
            results[f"{mb}MB"] = run(corpus, work, args.num_proc, env)
            corpus.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    small, large = results[f"{args.small}MB"]["prepare"], results[f"{args.large}MB"]["prepare"]
    ratio = large["peak_rss_mb"] / small["peak_rss_mb"]
    record = {"benchmark": "prepare_throughput", "num_proc": args.num_proc, "cpus": os.cpu_count(),
              "python": platform.python_version(), "results": results,
              "prepare_peak_ratio_large_over_small": round(ratio, 3),
              "acceptance": {"flat_within_1.25x": ratio <= 1.25, "under_1.5GB": large["peak_rss_mb"] < 1536}}
    (REPO / "benchmarks" / "results" / "prepare_throughput.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'corpus':>8} {'command':>13} {'wall s':>8} {'tokens/s':>10} {'peak RSS MB':>12}")
    for name, r in results.items():
        for command in ("prepare", "datasets_map"):
            c = r[command]
            print(f"{name:>8} {command:>13} {c['wall_s']:>8} {c['tokens_per_s']:>10,} {c['peak_rss_mb']:>12}")
    print(f"prepare peak large/small: {ratio:.3f} (<= 1.25: {ratio <= 1.25}); under 1.5 GB: {large['peak_rss_mb'] < 1536}")


if __name__ == "__main__":
    main()
