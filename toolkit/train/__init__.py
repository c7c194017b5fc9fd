"""The one training loop and what a rank runs: the worker (rank entry), the LR schedule.

The package is callable: ``toolkit.train(cfg)`` is ``toolkit.launch.run.train``, what ``toolkit train``
runs (the Python API)."""
from toolkit.callable_package import call_as_command


def command():
    """What calling this package runs (``toolkit.callable_package``)."""
    from toolkit.launch.run import train
    return train


call_as_command(__name__)
