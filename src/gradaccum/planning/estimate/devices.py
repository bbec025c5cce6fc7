"""What a GPU holds beside the caching allocator's segments, per GPU family: the constants the
estimate adds to reserved memory for the device total (what nvidia-smi shows), and the cuBLAS
workspace that PyTorch allocates through the caching allocator (so it is in allocated and
reserved too).

The cuBLAS workspace is PyTorch's default (``CUBLAS_WORKSPACE_CONFIG`` unset):
``:4096:2:16:8`` = 8 MiB + 128 KiB per cuBLAS handle and stream, 32 MiB on Hopper (sm90),
32 MiB on ROCm (at::cuda::getChosenWorkspaceSize in aten/src/ATen/cuda/CublasHandlePool.cpp).
A training step uses two handles: the forward's thread and autograd's device thread.

The CUDA context (driver state, kernels loaded lazily, cuDNN/cuBLAS handles) is not allocated
through PyTorch and is not visible to ``torch.cuda`` at all; it is assumed, per family, from
figures reported for CUDA 12 with lazy module loading (PyTorch's default); ``bench/gpu.py``
measures it where a GPU is (nvidia-smi's used memory minus reserved), and an estimate says which
value it assumed.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPU", "GPUS", "gpu"]

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory: int
    """Total device memory, bytes."""
    context: int
    """Assumed CUDA context and libraries outside the caching allocator, bytes."""
    workspace: int
    """cuBLAS workspace per handle and stream, bytes (through the caching allocator)."""
    handles: int = 2
    """cuBLAS handles a training step uses (forward thread, autograd's device thread)."""


_DEFAULT_WS = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
_HOPPER_WS = 4096 * 8 * 1024
_ROCM_WS = 1024 * 32 * 1024

GPUS = {
    g.name: g
    for g in (
        GPU("cuda", 24 * 10**9, 500 * MiB, _DEFAULT_WS),  # a generic NVIDIA card
        GPU("t4", 15_360 * MiB, 400 * MiB, _DEFAULT_WS),
        GPU("v100", 16_384 * MiB, 450 * MiB, _DEFAULT_WS),
        GPU("a10g", 23_028 * MiB, 500 * MiB, _DEFAULT_WS),
        GPU("l4", 23_034 * MiB, 500 * MiB, _DEFAULT_WS),
        GPU("rtx3090", 24_576 * MiB, 500 * MiB, _DEFAULT_WS),
        GPU("rtx4090", 24_564 * MiB, 500 * MiB, _DEFAULT_WS),
        GPU("a100-40gb", 40_960 * MiB, 520 * MiB, _DEFAULT_WS),
        GPU("a100-80gb", 81_920 * MiB, 520 * MiB, _DEFAULT_WS),
        GPU("h100", 81_559 * MiB, 600 * MiB, _HOPPER_WS),
        GPU("mi250", 65_520 * MiB, 300 * MiB, _ROCM_WS),
    )
}


def gpu(name: str | GPU | None) -> GPU:
    """A GPU family by name (``None``: a generic NVIDIA card)."""
    if isinstance(name, GPU):
        return name
    key = (name or "cuda").lower()
    if key not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}, got {name!r}")
    return GPUS[key]
