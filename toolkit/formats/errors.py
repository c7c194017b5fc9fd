"""The converter's one error type: every message names the problem and the fix."""


class ConvertError(RuntimeError):
    """A source or destination the converter refuses; DST is left untouched."""
