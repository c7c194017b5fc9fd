"""The reference scores' old address: they are the DPO objective's own hook now
(``toolkit/objectives/reference.py``); the names stay importable from here."""
from toolkit.objectives.reference import (  # noqa: F401
    REF_COLUMN,
    ReferenceScores,
    check_resumed,
    prepare_reference,
    reference_key,
    score,
    weights_sample,
)
