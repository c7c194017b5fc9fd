"""End-to-end tier: the CLI as a user runs it (``toolkit train``, ``convert``, ``supervise``), launched
jobs, built wheels and images."""
