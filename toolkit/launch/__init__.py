"""The supervisor: torch elastic's agent with a restart policy (``agent.py``), the launch of a
job's ranks (``elastic.py``), a multi-node roster (``roster.py``) and the devices a node offers
(``devices.py``). What a rank reports lives below, in ``toolkit/watch/``; what ``toolkit train``
does before and around the launch, above, in ``toolkit/run.py``."""
