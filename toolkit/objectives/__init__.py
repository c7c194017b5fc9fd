"""Training objectives, one file each behind one protocol (``base.Objective``): an engine calls the run's
objective on each micro-batch's scores and sums what it returns; the trainer asks it what the loss is a mean
over and runs its hook before the first step. Neither names an objective.

  sft.py        the mean token cross-entropy
  dpo.py        direct preference optimization (TRL's DPOTrainer), its reference scored once (reference.py)
  orpo.py       odds-ratio preference optimization (TRL's ORPOTrainer), reference-free

A new objective is a module here defining an ``Objective`` subclass with its ``name`` (found by ``resolve``,
never listed), plus its name and settings in ``toolkit/config.py``. The plan resolves the run's objective once
(``Plan.objective``).
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from toolkit.objectives.base import DocumentSums, Objective, Prepared, Scores, document_sums
from toolkit.objectives.dpo import DPO, DPO_METRICS, STATS
from toolkit.objectives.reference import REF_COLUMN

__all__ = ["Objective", "Scores", "Prepared", "resolve", "registered", "document_sums", "DocumentSums", "DPO",
           "DPO_METRICS", "STATS", "REF_COLUMN"]


@lru_cache(maxsize=1)
def registered() -> dict[str, type[Objective]]:
    """``train.objective`` -> its class: every ``Objective`` subclass defined in a module of this package."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Objective) and value.__module__ == module.__name__ \
                    and "name" in vars(value):
                found[value.name] = value
    return found


def resolve(cfg) -> Objective:
    """The run's objective (``train.objective``) with its settings."""
    objectives = registered()
    if cfg.train.objective not in objectives:
        raise ValueError(f"train.objective={cfg.train.objective!r} has no module in toolkit/objectives/; "
                         f"found {sorted(objectives)}")
    return objectives[cfg.train.objective].of(cfg)
