"""The ``convert``, ``inspect`` and ``verify`` commands over the format library (``toolkit/formats``):

  ``open_source(SRC)``  detect the format and return a reader (``formats.detect``)
  ``convert(SRC, DST, to=...)``  stream it into a writer at the requested layout, staged + manifest
  ``inspect(SRC)``  what a checkpoint is: format, family, layout, step, sizes, completeness
  ``verify(SRC, DST)``  in ``verify.py``: exact tensor round trip and matching logits

LoRA checkpoints and HF-PEFT directories are formats of the table too, converted whole by the
``toolkit/lora`` functions their lines name (``checkpoint.py``, ``convert.py``, ``dcp.py``, ``files.py``).
The package is callable: ``toolkit.convert(SRC, DST, to=...)`` is ``convert`` (the Python API).
"""
from __future__ import annotations

from toolkit.callable_package import call_as_command
from toolkit.convert.inspect import inspect
from toolkit.convert.run import convert
from toolkit.formats.detect import open_source
from toolkit.formats.errors import ConvertError

__all__ = ["ConvertError", "convert", "inspect", "open_source"]


call_as_command(__name__)
