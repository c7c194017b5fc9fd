"""The ``toolkit convert`` and ``toolkit inspect`` commands (argument parsing lives in toolkit/cli.py)."""
from __future__ import annotations

import contextlib
import json
import sys

from toolkit.formats.errors import ConvertError


@contextlib.contextmanager
def _named(path, path2=None):
    """An OS error raised without a path (a read or a write on a file already open) names the
    command's paths, so the command line says it as one line with them (``toolkit/cli.py``)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename, exc.filename2 = str(path), path2 and str(path2)
        raise


def cmd_convert(args) -> int:
    with _named(args.src, args.dst):
        return _convert(args)


def _convert(args) -> int:
    from toolkit.convert import convert
    from toolkit.formats.detect import locate
    from toolkit.heap import return_large_frees
    return_large_frees()  # freed tensors of a few MB go back to the OS between tensors (toolkit/heap.py)
    try:  # --verify reads SRC again: find its format once, for both
        src = locate(args.src, args.hf_config) if args.verify else args.src
        summary = convert(src, args.dst, to=args.to, tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp,
                          zero_stage=args.zero_stage, dtype=args.dtype, weights_only=args.weights_only,
                          hf_config=args.hf_config, show_progress=sys.stderr.isatty() or args.progress,
                          base=args.base, vocab_divisor=args.vocab_divisor)
    except ConvertError as exc:
        print(f"toolkit convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"converted {summary['from']} -> {summary['to']}: {summary['tensors']} tensors, step {summary['step']}, "
          f"optimizer state {'kept' if summary['optimizer_state'] else 'not written'}, {summary['reader']} reader, "
          f"{summary['seconds']} s -> {args.dst}")
    for note in summary.get("notes", ()):
        print(note)
    if args.verify:
        try:
            report = _verify(args, src)
        except ConvertError as exc:
            print(f"toolkit convert: error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(report.lines()))
        return 0 if report.ok else 1
    return 0


def _verify(args, found):
    """DST against SRC (``found``: where ``formats.detect.locate`` found it); LoRA adapters by
    ``lora/convert.py``'s ``verify_lora``."""
    from pathlib import Path

    from toolkit.formats.table import by_name
    if by_name(found.format).adapters:
        from toolkit.lora.convert import verify_lora
        return verify_lora(found, Path(args.dst), args.base, args.to)
    from toolkit.convert.verify import verify
    return verify(args.src, args.dst, args.hf_config)


def cmd_inspect(args) -> int:
    from toolkit.convert import inspect
    from toolkit.data.prepare import describe_prefix
    try:  # libraries imported on the way (DeepSpeed's logger) print to stdout: keep it for the answer
        with contextlib.redirect_stdout(sys.stderr), _named(args.path):
            info = describe_prefix(args.path) or inspect(args.path, args.hf_config)  # a data PREFIX, or a checkpoint
    except ConvertError as exc:
        print(f"toolkit inspect: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0
