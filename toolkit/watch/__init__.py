"""The in-rank watch, what a rank tells its supervisor (``toolkit/launch/``): heartbeats with phases
and their budgets, the rank monitor (stop requests, stack dumps, stragglers, divergence), the event
log, injected faults for tests, and the exit codes and files the supervisor reads (``protocol.py``).
Below ``train/``: the loop and the engines import it; it imports neither them nor the supervisor."""
