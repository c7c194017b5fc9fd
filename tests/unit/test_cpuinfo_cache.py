"""The cached py-cpuinfo answer DeepSpeed's CPU op builders read (toolkit/compat/cpuinfo_cache.py)."""
from __future__ import annotations

import cpuinfo
import pytest

from toolkit.compat import cpuinfo_cache


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """A fresh cache dir and a stand-in for the subprocess-starting original, counting its calls."""
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpuinfo_cache, "_installed", False)
    calls = []

    def original():
        calls.append(1)
        return {"flags": ["avx2", "avx512f"], "arch": "X86_64"}
    monkeypatch.setattr(cpuinfo, "get_cpu_info", original)
    return calls


def test_one_computation_serves_this_process_and_the_next(counted, monkeypatch):
    cpuinfo_cache.install()
    from cpuinfo import get_cpu_info  # as DeepSpeed's builders import it, at call time
    assert get_cpu_info() == get_cpu_info() == {"flags": ["avx2", "avx512f"], "arch": "X86_64"}
    assert len(counted) == 1
    files = list((cpuinfo_cache._cache_file().parent).glob("*.json"))
    assert [f.name for f in files] == [f"{cpuinfo_cache.cpu_identity()}.json"]
    # a later rank: nothing memoized in its process, the file answers
    monkeypatch.setattr(cpuinfo_cache, "_installed", False)
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: pytest.fail("the cached answer was not used"))
    cpuinfo_cache.install()
    assert cpuinfo.get_cpu_info()["flags"] == ["avx2", "avx512f"]


def test_a_damaged_cache_file_is_recomputed(counted):
    path = cpuinfo_cache._cache_file()
    path.parent.mkdir(parents=True)
    path.write_text('{"flags": [')  # half a file, as a crash mid-write by a tool without our rename would leave
    cpuinfo_cache.install()
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and len(counted) == 1
    assert cpuinfo_cache._cached(lambda: pytest.fail("recomputed twice"))["arch"] == "X86_64"

