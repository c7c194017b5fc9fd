"""megatron-core version patches that hold on every device (the CPU-only layer is ``megatron_cpu``).

Each patch names the megatron-core behaviour it works around; all are for 0.16.x, the pinned
release, and each is a no-op where that behaviour is absent.
"""
from __future__ import annotations


def bind_missing_te_names() -> None:
    """megatron-core 0.16's MoE router GEMM tests ``te_general_gemm is not None``, a name
    ``moe_utils`` binds only when Transformer Engine imports: without TE (our images remove it) the
    router raises NameError on CPU and GPU alike. Bound to None, the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
