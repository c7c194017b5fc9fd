"""Fault tolerance: an elastic agent with a restart policy, heartbeats, hang/straggler/divergence
detection, preemption, an event log and a fault injector for tests."""
