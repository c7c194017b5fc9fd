"""Packages that are also their command's function: ``toolkit.convert`` and ``toolkit.train``.

The Python API calls ``toolkit.convert(src, dst)`` and ``toolkit.train(cfg)``, yet those names must
stay the packages: importing a package rebinds its parent's attribute to it, and
``import toolkit.convert.run`` or ``monkeypatch.setattr("toolkit.convert.megatron.X", ...)`` walk
its attributes. So the package itself is made callable. Which function it runs is the front door's
table (``toolkit._COMMANDS``), looked up at each call: ``toolkit/train/`` lies below what
``toolkit train`` does (``toolkit/run.py``, which launches ranks that run the loop) and imports none of it.
"""
from __future__ import annotations

import sys
import types


class CommandPackage(types.ModuleType):
    """Calling the package calls its command, ``toolkit._COMMANDS[package]``."""

    def command(self):
        import importlib
        module, function = sys.modules["toolkit"]._COMMANDS[self.__name__]
        return getattr(importlib.import_module(module), function)

    def __call__(self, *args, **kwargs):
        return self.command()(*args, **kwargs)

    @property
    def __signature__(self):  # inspect.signature and IDEs show the command's parameters
        import inspect
        return inspect.signature(self.command())


def call_as_command(package: str) -> None:
    """Make the (imported) ``package`` callable as its command (``toolkit._COMMANDS``)."""
    sys.modules[package].__class__ = CommandPackage
