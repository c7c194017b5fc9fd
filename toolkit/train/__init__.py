"""The one training loop and what a rank runs: the worker (rank entry), the LR schedule.

The package is callable: ``toolkit.train(cfg)`` is ``toolkit.run.train``, what ``toolkit train``
runs (the Python API; ``toolkit._COMMANDS``)."""
from toolkit.callable_package import call_as_command

call_as_command(__name__)
