"""Fixtures of the GPU layer."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def strict_fp32():
    """fp32 matmuls and convolutions with TF32 off, for the kernel tests that compare with float64."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
