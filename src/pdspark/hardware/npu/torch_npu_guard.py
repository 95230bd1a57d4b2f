"""The one place pdspark imports `torch_npu`, guarded by a successful import.

Installing torch-npu without Ascend CANN breaks `import torch` itself (its autoload entry point raises), and with
`TORCH_DEVICE_BACKEND_AUTOLOAD=0` `find_spec("torch_npu")` is truthy while `import torch_npu` fails: so the guard is
the import, never `find_spec`. Nothing outside `pdspark.hardware.npu` imports this module.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType


@cache
def import_torch_npu() -> tuple[ModuleType | None, str]:
    """(`torch_npu`, "") when it imports and an NPU is visible, else (None, what is missing)."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as e:  # ImportError without the package; OSError/RuntimeError without CANN's libraries
        return None, f"`import torch_npu` failed ({type(e).__name__}: {e}); install torch-npu with Ascend CANN"
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return None, "torch_npu imported, but no Ascend NPU is available (driver, ASCEND_RT_VISIBLE_DEVICES)"
    return torch_npu, ""
