"""What a rank and its supervisor agree on besides heartbeats and events: the exit codes the agent
reads (``launch/agent.py``) and where a rank writes its stack when the watchdog asks."""

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later" - the job saved and stopped on request
REFUSED_EXIT = 78  # EX_CONFIG: a rank refused the run (a config error, e.g. every checkpoint damaged): never retried
STACKS_DIR = "stacks"
