"""``toolkit train --dry-run`` checks what the launch checks before it starts a rank: the data (path,
format, columns, enough packed samples for a global batch) and the machine (``check_machine``), not
only the config. It exited 0 on ``data.path=does/not/exist.jsonl``, which the run refuses in seconds.
Each bad input here is refused by the dry run and by the run itself with the same message, exit 2,
and neither leaves a run directory; a dry run that passes has tokenized and packed the data into the
cache the run then reads."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import TINY, refused, train_args

MISSING = "does/not/exist.jsonl"


def _bad_inputs(tmp):
    (tmp / "broken.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"\n')
    (tmp / "other_columns.jsonl").write_text('{"question": "a", "response": "b"}\n')
    instruction = ["data.template=instruction", "data.prompt_column=prompt", "data.response_column=response"]
    return {
        "missing path": ([f"data.path={MISSING}"], f"data.path: {MISSING} not found"),
        "not json": ([f"data.path={tmp / 'broken.jsonl'}"], "could not be read as json (data.format): ArrowInvalid"),
        "missing column": ([f"data.path={tmp / 'other_columns.jsonl'}", *instruction],
                           "data.prompt_column='prompt' is not a column of data.path="),
        "too little data": (["train.global_batch_size=4096", "train.micro_batch_size=1", "data.seq_len=512"],
                            "fewer than train.global_batch_size=4096; lower data.seq_len"),
    }


CASES = ["missing path", "not json", "missing column", "too little data"]


@pytest.mark.parametrize("case", CASES)
def test_dry_run_refuses_what_the_run_refuses(case, tmp_path, data_cache):
    sets, message = _bad_inputs(tmp_path)[case]
    args = train_args(tmp_path / "run", data_cache, *sets, nproc=1)
    for command in ([*args, "--dry-run"], args):
        code, out, err = refused(command)
        assert code == 2 and message in err, (command[-1], code, out[-1500:], err[-1500:])
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex attention trains on a GPU")
def test_dry_run_refuses_what_this_machine_cannot_run(tmp_path, data_cache):
    args = train_args(tmp_path / "run", data_cache, "backend=megatron", "megatron.attention=flex")
    code, _, err = refused([*args, "--dry-run"])
    assert code == 2 and "megatron.attention=flex needs a GPU to train" in err


def test_a_passing_dry_run_prepared_the_data_the_run_reads(tmp_path):
    cache = tmp_path / "cache"
    args = [*train_args(tmp_path / "run", cache), "--dry-run"]
    code, out, err = refused(args)  # in this process, as a test of a refusal runs it
    assert code == 0, err[-2000:]
    rows = [line for line in out.splitlines() if line.startswith("# data: ")]
    seq_len = next(int(s.split("=")[1]) for s in TINY if s.startswith("data.seq_len="))
    assert len(rows) == 1 and f"train rows of {seq_len} (concat)" in rows[0] and str(cache) in rows[0], rows
    assert list((cache / "packed").glob("*.arrow")) and not (tmp_path / "run").exists()
    assert "no process group was started" in out
