"""Checkpoint converter: HF <-> DeepSpeed ZeRO <-> Megatron-core around one canonical stream.

  ``open_source(SRC)``  detect the format and return a reader (``canonical.Source``)
  ``convert(SRC, DST, to=...)``  stream it into a writer at the requested layout, staged + manifest
  ``inspect(SRC)``  what a checkpoint is: format, family, layout, step, sizes, completeness
  ``verify(SRC, DST)``  in ``verify.py``: exact tensor round trip and matching logits

Only this package and ``toolkit/adapters`` know DeepSpeed's and Megatron's file layouts.
The package is callable: ``toolkit.convert(SRC, DST, to=...)`` is ``convert`` (the Python API).
"""
from __future__ import annotations

from toolkit.callable_package import call_as_command
from toolkit.convert.detect import inspect, open_source
from toolkit.convert.errors import ConvertError
from toolkit.convert.run import convert

__all__ = ["ConvertError", "convert", "inspect", "open_source"]


def command():
    """What calling this package runs (``toolkit.callable_package``)."""
    return convert


call_as_command(__name__)
