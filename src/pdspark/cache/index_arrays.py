"""`Indices`: page, slot and row numbers as torch tensors or NumPy arrays, whichever the caller holds (the host page
tables are NumPy views, the device paths hold tensors). A function from `Indices` to `Indices` keeps the kind."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

Indices = TypeVar("Indices", torch.Tensor, np.ndarray)
