"""Conversion outputs are built in a staging directory beside DST, given a sha256 manifest and a
COMPLETE marker, and renamed into place only when whole: an interrupted conversion leaves DST
absent, never half-written (the checkpoint manager's protocol, reused)."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from toolkit.formats.errors import ConvertError
from toolkit.storage import COMPLETE, MANIFEST, build_manifest, verify_complete, write_json_durable
from toolkit.storage.space import describe_error, looks_full, path_error


@contextlib.contextmanager
def staged(dst: Path):
    """Yield a fresh staging directory; on success it becomes ``dst`` atomically."""
    dst = Path(dst).resolve()
    if dst.exists():
        raise ConvertError(f"{dst} already exists; the converter never overwrites - remove it or choose another DST")
    stage = dst.parent / f".staging-{dst.name}-{os.getpid()}"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir()
    except OSError as exc:
        raise ConvertError(f"DST {dst} cannot be written: {path_error(exc) or exc}") from None
    try:
        yield stage
        write_json_durable(stage / MANIFEST, build_manifest(stage))
        write_json_durable(stage / COMPLETE, {"complete": True})
        os.replace(stage, dst)
    except Exception as exc:
        full = not isinstance(exc, ConvertError) and looks_full(exc, stage)  # measured before the partial output goes
        shutil.rmtree(stage, ignore_errors=True)
        if full:
            raise ConvertError(f"the disk holding {dst.parent} is full ({describe_error(exc)}); {dst} was not written: "
                               "free space there, or choose a DST on another disk") from exc
        raise
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def check_manifest(path: Path) -> None:
    """SRC with a manifest (ours, the trainer's) must match it byte for byte before it is read."""
    root = Path(path)
    for cand in (root, root.parent, root.parent.parent):
        if (cand / MANIFEST).is_file():
            problems = verify_complete(cand)
            if problems:
                raise ConvertError(f"{cand} does not match its manifest: " + "; ".join(problems[:5]) +
                                   " - the checkpoint is damaged; convert an intact copy")
            return
