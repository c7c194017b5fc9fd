"""The one training loop and what a rank runs: the worker (rank entry), the LR schedule."""
