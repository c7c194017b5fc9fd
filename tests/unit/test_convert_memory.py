"""The two mechanisms that keep a conversion's RSS within a few tensors of its floor
(``toolkit/formats/pages.py``, ``toolkit/heap.py``); the figures per conversion path are in benchmarks/convert.py.

Bugs these catch: freed tensors' pages kept by glibc's heap (the megatron writer grew by 100-300 MB
over a write), a safetensors source's pages staying resident as it is read (an HF -> Megatron
conversion ended holding the whole model), and a release that loses data.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.runs import REPO
from toolkit import heap
from toolkit.formats import pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or heap._trim is None
                                or "MALLOC_MMAP_THRESHOLD_" in os.environ,
                                reason="glibc (malloc_trim, its dynamic mmap threshold) and /proc only")


def test_trim_heap_gives_back_freed_tensors_kept_by_the_heap():
    """As a streaming writer allocates (``tests/helpers/heap.py::kept_and_trimmed``), in a fresh process:
    this one's mmap threshold may have been fixed by an in-process ``toolkit convert`` (``toolkit/heap.py``),
    under which the freed tensors would have gone back by themselves."""
    out = subprocess.run([sys.executable, "-m", "tests.helpers.heap", "trim"], cwd=REPO, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    mb = json.loads(out)
    print(f"anonymous MB: {mb['held']:.0f} held, {mb['after_free']:.0f} after freeing 23 x 8 MiB, "
          f"{mb['after_trim']:.0f} after trim_heap")
    assert mb["held"] - mb["after_free"] < 20  # freeing gave back nothing: the heap kept the pages
    assert mb["after_free"] - mb["after_trim"] > 150  # trim_heap gave them back


def test_source_maps_release_a_safetensors_source_pages_and_lose_nothing(tmp_path):
    from safetensors.torch import save_file

    from toolkit.formats.hf import HFSource
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    weight = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))  # 16 MB
    save_file({"w": weight}, str(model / "model.safetensors"))
    source = HFSource(model)
    maps = pages.SourceMaps(model)
    assert maps.ranges, "the safetensors shard is mapped when the source opens it"
    assert torch.equal(source.read("w"), weight)
    resident = _mapped_rss_kb(maps)
    maps.release()
    released = _mapped_rss_kb(maps)
    print(f"shard pages resident: {resident} kB after a read, {released} kB after release")
    assert resident >= 15 * 1024 and released < 1024
    assert torch.equal(source.read("w"), weight)  # read again from the page cache: nothing lost


def _mapped_rss_kb(maps: pages.SourceMaps) -> int:
    """Rss of this process's mappings that ``maps`` holds (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = any(a <= lo and hi <= b for a, b in maps.ranges)
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total
