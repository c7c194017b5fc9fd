"""The reference scores' old address: they are an objective's own hook now (``toolkit/objectives/reference.py``);
the names stay importable from here for the code and tests that import them so."""
from toolkit.objectives.reference import (  # noqa: F401
    REF_COLUMN,
    ReferenceScores,
    check_resumed,
    prepare_reference,
    reference_key,
    score,
    weights_sample,
)
