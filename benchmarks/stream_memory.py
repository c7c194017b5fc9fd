"""``data.streaming``: peak memory of one rank's data pipeline over a whole pass of two source sizes.

Each size in its own process: ``StreamBatches`` (``toolkit/data/stream.py``) makes every global batch (16 rows
of 1,024 tokens, the demo tokenizer) of one full pass over a synthetic text corpus of --small and --large MB
(``benchmarks/data_pipeline.py::make_corpus``); the process's peak RSS (``ru_maxrss``) after the pass, and
the rows/s of the pipeline, are compared. Memory should hold a chunk of rows, not the source.

Writes benchmarks/results/stream_memory.json.

  python benchmarks/stream_memory.py [--small 10] [--large 40]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from data_pipeline import make_corpus  # noqa: E402

CHILD = """
import json, resource, sys, time
from toolkit.config import load_config
from toolkit.data import load_tokenizer
from toolkit.data.stream import StreamBatches
cfg = load_config(None, [f"data.path={sys.argv[1]}", "data.streaming=true", "data.eval_fraction=0", "data.seq_len=1024",
                         "train.global_batch_size=16", "train.micro_batch_size=4"])
stream = StreamBatches(cfg, load_tokenizer(cfg))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
tic, step, rows = time.perf_counter(), 0, 0
while stream.position(step)["epoch"] == 0:
    rows += len(stream.global_batch(step, 16))
    step += 1
print(json.dumps({"steps": step, "rows": rows, "rows_per_s": round(rows / (time.perf_counter() - tic), 1),
                  "peak_rss_mb_after_setup": round(before, 1),
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=10)
    ap.add_argument("--large", type=int, default=40)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    results = {}
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as work:
        for mb in (args.small, args.large):
            corpus = Path(work) / f"corpus{mb}.jsonl"
            text = Path(work) / "plain.txt"
            make_corpus(text, mb)
            with open(text) as src, open(corpus, "w") as dst:
                for line in src:
                    dst.write(json.dumps({"text": line.rstrip("\n")}) + "\n")
            out = subprocess.run([sys.executable, "-c", CHILD, str(corpus)], cwd=REPO, env=env, capture_output=True,
                                 text=True, check=True)
            results[f"{mb}MB"] = {"corpus_bytes": corpus.stat().st_size, **json.loads(out.stdout.strip().splitlines()[-1])}
    small, large = results[f"{args.small}MB"], results[f"{args.large}MB"]
    ratio = large["peak_rss_mb"] / small["peak_rss_mb"]
    record = {"benchmark": "stream_memory", "results": results, "peak_ratio_large_over_small": round(ratio, 3)}
    (REPO / "benchmarks" / "results" / "stream_memory.json").write_text(json.dumps(record, indent=2) + "\n")
    for name, r in results.items():
        print(f"{name:>6}: {r['steps']} steps, {r['rows']} rows, {r['rows_per_s']} rows/s, peak RSS {r['peak_rss_mb']} MB")
    print(f"peak large/small: {ratio:.3f}")


if __name__ == "__main__":
    main()
