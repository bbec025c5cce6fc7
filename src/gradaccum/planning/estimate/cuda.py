"""What differs between the traced device (fake CPU tensors) and CUDA, modelled in the trace.
Each difference is named in docs/planning.md ("What the trace models of CUDA"):

- ``CudaModel``: the kernels CUDA would pick where the CPU picks others, and CUDA's autocast.
  Attention (``scaled_dot_product_attention``) runs as CUDA's flash kernel (fp16/bf16 without a
  mask) or its memory-efficient kernel (otherwise): each keeps the output and a log-sum-exp,
  never the attention matrix, also with dropout (the CPU falls back to the matrix with a mask
  or dropout). Dropout runs as CUDA's fused kernel, whose mask is one byte per element (the
  CPU's is a tensor of the input's dtype). Autocast follows CUDA's op lists for bf16 and fp16
  (aten/src/ATen/autocast_mode.cpp), with its cache of each parameter's low-precision copy for
  the whole forward. Both hold inside backward too, where activation checkpointing recomputes
  a block's forward: torch runs backward with no function mode on, so the mode enters itself
  again around every backward, and ``torch.utils.checkpoint`` restores the autocast state of
  the block's forward for its recomputation (its ``cache_enabled``, which this model marks).
- ``prefer_foreach``: torch.optim picks its foreach implementation when every parameter is on
  CUDA (``_default_to_fused_or_foreach``); the CPU gets the per-parameter loop, whose
  temporaries are one parameter's, not all of them at once.
- ``host_serials``: an optimizer's ``step`` counter stays on the host unless ``fused`` or
  ``capturable`` (torch.optim's Adam family), so it is no device allocation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["CudaModel", "host_serials", "prefer_foreach"]

_aten = torch.ops.aten


def _dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0 or p == 1 or inplace:
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: the kernels see whole heads
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
        out = _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, return_debug_mask=False, scale=scale
        )
        return out[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # the memory-efficient kernel takes an additive bias: CUDA's dispatch converts it
        bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
        attn_mask = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    out = _aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
    )
    return out[0]


# CUDA autocast's lists (aten/src/ATen/autocast_mode.cpp, "lower_precision_fp" and "fp32"),
# at the level of the Python functions that reach those ops
_LOW = {
    F.linear,
    F.bilinear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    F.prelu,
    F.scaled_dot_product_attention,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.baddbmm,
    torch.addmm,
    torch.addbmm,
    torch.addmv,
    torch.mv,
    torch.einsum,
    torch.chain_matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.mm,
    torch.Tensor.bmm,
    torch.Tensor.baddbmm,
    torch.Tensor.addmm,
}
_FP32 = {
    F.softmax,
    F.log_softmax,
    F.layer_norm,
    F.group_norm,
    F.cross_entropy,
    F.nll_loss,
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.kl_div,
    F.binary_cross_entropy_with_logits,
    F.cosine_similarity,
    F.softplus,
    torch.softmax,
    torch.log_softmax,
    torch.exp,
    torch.log,
    torch.log1p,
    torch.rsqrt,
    torch.pow,
    torch.cumsum,
    torch.cumprod,
    torch.prod,
    torch.sum,
    torch.norm,
    torch.logsumexp,
    torch.Tensor.softmax,
    torch.Tensor.log_softmax,
    torch.Tensor.exp,
    torch.Tensor.log,
    torch.Tensor.rsqrt,
    torch.Tensor.pow,
    torch.Tensor.sum,
    torch.Tensor.cumsum,
    torch.Tensor.norm,
}
_PROMOTE = {torch.cat, torch.stack, torch.addcmul, torch.addcdiv, torch.index_put}


def _backward(tensors, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``Tensor.backward`` and ``torch.autograd.backward`` as torch runs them past their
    ``__torch_function__`` check, which a mode on the stack would answer again."""
    return _engine(tensors, gradient, retain_graph, create_graph, inputs, accumulate=True)


def _grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, **how):
    if how.get("is_grads_batched") or how.get("materialize_grads"):
        raise NotImplementedError("torch.autograd.grad's batched or materialized grads")
    return _engine(
        outputs, grad_outputs, retain_graph, create_graph, inputs, accumulate=False, **how
    )


def _engine(tensors, grads, retain_graph, create_graph, inputs, accumulate, **how):
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grads is None or isinstance(grads, torch.Tensor):
        grads = [grads] * len(tensors) if grads is None else [grads]
    grads = tuple(
        torch.ones_like(t, memory_format=torch.preserve_format) if g is None else g
        for t, g in zip(tensors, grads, strict=True)
    )
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
    retain = create_graph if retain_graph is None else retain_graph
    return torch.autograd.Variable._execution_engine.run_backward(
        tensors,
        grads,
        retain,
        create_graph,
        inputs,
        how.get("allow_unused", False) or accumulate,
        accumulate,
    )


# what runs a backward: torch runs it with no function mode on (a mode is off the stack while
# it answers a call), so the mode runs the engine itself with itself on the stack, and a
# checkpointed block's recomputation in backward runs under it as the block's forward did
_BACKWARDS = {
    torch.Tensor.backward: _backward,
    torch.autograd.backward: _backward,
    torch.autograd.grad: _grad,
}


class CudaModel(TorchFunctionMode):
    """CUDA's kernels and, with ``autocast`` (bf16 or fp16), CUDA's autocast inside the regions
    ``region()`` opens (see the module's docstring)."""

    def __init__(self, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = autocast
        # the cache of parameters' casts of the forward region open now (None: none open)
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """One autocast region: the Accumulator's forward of a micro-batch. Autocast's cache
        lives as long as the region. The region is marked by autocast's ``cache_enabled`` set
        off (nothing on the traced CPU autocasts, so the flag changes nothing else), which
        ``torch.utils.checkpoint`` saves with a block's forward and sets again for its
        recomputation in backward: the cast then happens there too, as CUDA's autocast
        restored by the checkpoint does (its own cache, cleared at the recomputation's end,
        holds no copy the saved tensors do not)."""
        previous = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        self.cache = {}
        try:
            yield
        finally:
            self.cache = None
            torch.set_autocast_cache_enabled(previous)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            if func is torch.autograd.backward and "grad_tensors" in kwargs:
                kwargs["gradient"] = kwargs.pop("grad_tensors")
            with self:
                return _BACKWARDS[func](*args, **kwargs)
        if self.dtype is not None and not torch.is_autocast_cache_enabled():
            args, kwargs = self._autocast(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return _attention(*args, **kwargs)
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def _autocast(self, func, args, kwargs):
        if func in _LOW:
            return self._cast(args, self.dtype), self._cast(kwargs, self.dtype)
        if func in _FP32:
            return self._cast(args, torch.float32), self._cast(kwargs, torch.float32)
        if func in _PROMOTE:
            floats = [
                t.dtype
                for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            ]
            if floats:
                widest = max(floats, key=lambda d: torch.finfo(d).bits)
                return self._cast(args, widest), self._cast(kwargs, widest)
        return args, kwargs

    def _cast(self, tree: Any, dtype: torch.dtype) -> Any:
        cache = self.cache

        def cast(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
                return t
            if cache is not None and dtype != torch.float32 and t.is_leaf and t.requires_grad:
                held = cache.get(id(t))
                if held is None or held[0] is not t:
                    held = (t, t.to(dtype))
                    cache[id(t)] = held
                return held[1]
            return t.to(dtype)

        return torch.utils._pytree.tree_map(cast, tree)


def prefer_foreach(optimizer: torch.optim.Optimizer) -> bool:
    """Set ``foreach=True`` in each parameter group that leaves it to torch's default and is
    not fused; True if any group changed."""
    changed = False
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = changed = True
    return changed


def host_serials(optimizer: torch.optim.Optimizer, serial) -> set[int]:
    """Serials (``serial(tensor)``) of the optimizer's state that stays on the host."""
    out = set()
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                s = serial(step)
                if s is not None:
                    out.add(s)
    return out
