"""An accelerator on a CPU machine, for counting host synchronizations.

``OnDevice`` wraps a real CPU tensor in a tensor that reports ``is_cpu`` False (device
"meta": no storage of its own): every operation on it runs on the wrapped CPU tensor and
comes back wrapped, so a model, its autograd, an optimizer and gradaccum run on it as they
would on a GPU, with the same numbers. What a GPU would have to wait for is what reads a
value back to the host: ``item()`` (``float()``, ``int()``, ``bool()`` and ``if``),
``.cpu()``/``.to("cpu")`` and ``tolist()``. Each is counted in ``OnDevice.reads``. A tensor
made with ``device=`` the fake device holds no data, and any use of it raises: code must
derive new tensors from those it has (``x.new_zeros``), as code that runs on any device does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


class OnDevice(torch.Tensor):
    reads: list[str] = []  # what read a value back to the host, in order

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            dtype=elem.dtype,
            device="meta",
            requires_grad=elem.requires_grad,
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    def tolist(self) -> Any:
        OnDevice.reads.append("tolist")
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        device = kwargs.get("device")
        to_host = name == "_to_copy" and device is not None and torch.device(device).type == "cpu"
        if name == "_local_scalar_dense" or to_host:
            OnDevice.reads.append(name)

        def unwrap(x: Any) -> Any:
            if isinstance(x, OnDevice):
                return x.elem
            if isinstance(x, torch.Tensor) and x.device.type == "meta":
                raise RuntimeError(f"{name}: a tensor made on the device with device=, no data")
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if to_host:
            return out
        if name.endswith("_"):  # in place: the same tensors, or None for a list of them
            return args[0] if isinstance(args[0], OnDevice) else out
        return tree_map(lambda x: cls(x) if isinstance(x, torch.Tensor) else x, out)


def on_device(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter on the fake device (its values unchanged)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(OnDevice(p.detach().clone())))
    return model


def host(value: Any) -> Any:
    """A tensor's values without counting a read (for the test's own checks)."""
    return value.elem if isinstance(value, OnDevice) else value
