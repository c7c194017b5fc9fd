"""Unit tier: in-process tests, no process group and no launched job."""
