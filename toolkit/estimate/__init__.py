"""What a planned run will cost, before anything is launched: it reads the plan (``toolkit.plan``),
never an engine.

  ``memory.py``    memory per rank of a layout, which layouts fit, suggestions when none does
  ``steptime.py``  step time at a cluster: compute at a peak, each collective by an alpha-beta model
  ``flops.py``     model FLOPs per token and MFU (also what ``toolkit train`` logs)
  ``goodput.py``   the share of wall time on steps that count, given the MTBF, saves and recovery
  ``run.py``       ``toolkit estimate`` and ``toolkit train --dry-run``: the tables, or JSON
"""
