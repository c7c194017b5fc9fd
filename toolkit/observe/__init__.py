"""Observability: metrics sinks, the profiler, run reports and plots, toolkit doctor."""
