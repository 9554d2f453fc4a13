"""float64 tensors of literal values, for the math tests' references computed by hand."""

from __future__ import annotations

import torch

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)
