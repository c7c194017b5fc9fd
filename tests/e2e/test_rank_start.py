"""What a restarted rank does not redo: ranks forked from the launcher's forkserver (which outlives
restarts) find DeepSpeed's JIT-built ops already loaded and its lazily imported Muon module (torch.compile
at import) already imported. Bugs this catches: an op left for each rank to load (ninja and a build lock
per rank and restart: a rank killed holding the lock stalls the next ones), 2.5 s of imports back in
every restarted rank's engine build."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.runs import REPO

PROBE = '''
import json, multiprocessing, sys

from toolkit.train.worker import preload_modules


def probe(queue):
    from deepspeed.ops.op_builder.builder import OpBuilder
    queue.put({"ops": sorted(OpBuilder._loaded_ops),
               "muon": "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules})


if __name__ == "__main__":
    multiprocessing.set_forkserver_preload(list(preload_modules("deepspeed")))
    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.Queue()
    child = ctx.Process(target=probe, args=(queue,))
    child.start()
    print(json.dumps(queue.get(timeout=600)))
    child.join()
'''


def test_a_forked_rank_finds_the_ops_loaded_and_the_lazy_modules_imported(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"ops": ["deepspeed_shm_comm", "fused_adam"], "muon": True}
