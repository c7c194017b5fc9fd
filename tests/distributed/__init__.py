"""Distributed tier: tests that start gloo ranks themselves (``tests.helpers.ranks.run_ranks``)."""
