"""What ``--verify`` found: tensors and Adam moments compared, those that differ, and the logits of a
fixed batch (``convert/verify.py`` for every format; ``lora/`` for adapters)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    tensors: int = 0
    moments: int = 0
    mismatched: list[str] = field(default_factory=list)
    logits_max_diff: float | None = None
    logits_tol: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatched and (self.logits_max_diff is None or self.logits_max_diff <= self.logits_tol)

    def lines(self) -> list[str]:
        out = [f"tensors: {self.tensors} compared, {len(self.mismatched)} differ"
               + (f" ({', '.join(self.mismatched[:5])})" if self.mismatched else ""),
               f"optimizer moments: {self.moments} compared"]
        if self.logits_max_diff is not None:
            out.append(f"logits: max |diff| {self.logits_max_diff:.3g} (allowed {self.logits_tol:g})")
        out.append("verify: OK" if self.ok else "verify: MISMATCH")
        return out
