"""A frozen 8-bit or 4-bit base, as bitsandbytes stores and runs it under LoRA (QLoRA): modelled,
because bitsandbytes' kernels do not run on fake tensors (docs/planning.md, "A quantized
base"). ``quantize(model, kind)`` replaces each frozen ``nn.Linear`` but the output embedding
with a stand-in that holds what bitsandbytes holds and allocates, in its forward and backward,
what its training path allocates (bitsandbytes/autograd/_functions.py, ``MatMul4Bit``,
``MatMul8bitLt``; bitsandbytes/functional.py, ``quantize_4bit``):

- ``nf4`` / ``fp4`` (``Linear4bit``): the weight packed two values a byte (``uint8``,
  ``((n + 1) // 2, 1)``), a ``float32`` absmax per block of 64 values and a 16-entry
  ``float32`` code per layer; with double quantization (``bnb_4bit_use_double_quant``) the
  absmax is ``uint8`` with a ``float32`` absmax per 256 of them, a 0-d ``float32`` offset per
  layer and one 256-entry ``float32`` map shared by all. Forward and backward each dequantize
  the weight to the compute dtype (the dequantize-then-linear path bitsandbytes takes at
  training's row counts; its fused kernel for a few rows needs less), one layer at a time;
  nothing of the weight is saved for the backward, but the layer's input is (``MatMul4Bit``
  keeps ``ctx.tensors = (A, B)`` whenever A needs a gradient), as a context attribute that
  saved-tensor hooks, and so non-reentrant checkpointing, do not see. PEFT's LoRA layer
  over a 4-bit layer clones the base's output.
- ``8bit`` (``Linear8bitLt``, ``has_fp16_weights=False``): the weight ``int8`` with a
  ``float32`` scale per row (``SCB``). Forward: the input cast to ``float16``, quantized to
  ``int8`` with a ``float32`` scale per row, an ``int32`` product, the output in the input's
  dtype; the input kept for the backward. Backward: the weight dequantized to the input's dtype.
  The outlier columns above the threshold (6.0), which depend on the values, are taken as none.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["BLOCK_4BIT", "KINDS", "GPTQLinear", "Quantized4bit", "Quantized8bit", "quantize"]

BLOCK_4BIT = 64  # quantize_4bit's default blocksize
NESTED_BLOCK = 256  # double quantization: one float32 absmax per 256 uint8 absmax
KINDS = ("8bit", "nf4", "fp4", "gptq")
GPTQ_GROUP = 128  # auto-gptq's and transformers' GPTQConfig default group size


class _Dequantized(torch.autograd.Function):
    """x @ W.T with W dequantized for the product and dropped after it, in both passes."""

    @staticmethod
    def forward(ctx, x, bias, shape, dtype):
        ctx.shape, ctx.dtype = shape, dtype
        # MatMul4Bit keeps its input (ctx.tensors = (A, B)) whenever it needs a gradient, though
        # the backward reads only the weight: held to the backward, past saved-tensor hooks
        ctx.x = x if ctx.needs_input_grad[0] else None
        weight = torch.empty(shape, dtype=dtype, device=x.device)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad.device)
        return torch.matmul(grad.to(ctx.dtype), weight), None, None, None


class Quantized4bit(torch.nn.Linear):
    """bitsandbytes' ``Linear4bit`` as it is held and run (see the module's docstring)."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        *,
        double_quant: bool,
        compute_dtype: torch.dtype,
        nested_code: torch.Tensor | None,
    ) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype, self.clone_output = compute_dtype, False
        n, device = linear.in_features * linear.out_features, linear.weight.device
        packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        blocks = math.ceil(n / BLOCK_4BIT)
        if double_quant:
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
            nested = math.ceil(blocks / NESTED_BLOCK)
            self.register_buffer("absmax2", torch.empty(nested, dtype=torch.float32, device=device))
            self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=device))
            self.register_buffer("code2", nested_code)
        else:
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, device=device))
        self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = x.dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        shape = (self.out_features, self.in_features)
        out = _Dequantized.apply(x.to(self.compute_dtype), bias, shape, self.compute_dtype)
        out = out.to(given)
        return out.clone() if self.clone_output else out


class _Int8(torch.autograd.Function):
    """MatMul8bitLt's allocations with a frozen int8 weight (see the module's docstring)."""

    @staticmethod
    def forward(ctx, x, bias, out_features):
        rows = x.reshape(-1, x.shape[-1])
        half = rows.to(torch.float16)  # int8_vectorwise_quant(A.to(torch.float16))
        quantized = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
        scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        del half
        product = torch.empty(rows.shape[0], out_features, dtype=torch.int32, device=x.device)
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
        del product, quantized, scale
        if bias is not None:
            out = out + bias.to(x.dtype)
        ctx.x = x  # MatMul8bitLt keeps its input (ctx.tensors)
        ctx.out_features = out_features
        return out.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.x
        rows = grad.reshape(-1, grad.shape[-1]).contiguous()
        weight = torch.empty(ctx.out_features, x.shape[-1], dtype=x.dtype, device=x.device)
        return torch.matmul(rows.to(x.dtype), weight).view(x.shape), None, None


class Quantized8bit(torch.nn.Linear):
    """bitsandbytes' ``Linear8bitLt`` (``has_fp16_weights=False``) as it is held and run."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.clone_output = False
        device = linear.weight.device
        weight = torch.empty(linear.weight.shape, dtype=torch.int8, device=device)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = linear.bias
        self.register_buffer(
            "SCB", torch.empty(linear.out_features, dtype=torch.float32, device=device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Int8.apply(x, self.bias, self.out_features)
        return out.clone() if self.clone_output else out


class GPTQLinear(torch.nn.Module):
    """A GPTQ 4-bit layer as auto-gptq's ``QuantLinear`` holds and trains it
    (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py: the layer ``GPTQConfig(bits=4,
    disable_exllama=True)`` loads, which training needs): ``qweight`` int32 ``(in / 8, out)``
    (eight 4-bit values a word), ``qzeros`` int32 ``(groups, out / 8)``, ``scales`` float16
    ``(groups, out)``, ``g_idx`` int32 ``(in,)``, a float16 bias where the layer has one.
    At training's row counts (past its kernel's 128-row switch) the forward dequantizes in
    torch: the words shifted into an int32 ``(in / 8, 8, out)`` and narrowed to int8, the
    zeros likewise per group, ``scales * (weight - zeros)`` a float16 ``(in, out)`` weight,
    then ``matmul(x.half(), weight)``; autograd keeps that float16 weight for the input's
    gradient (the weight needs none), so each layer's dequantized weight lives until its
    backward, unless checkpointing recomputes it there."""

    def __init__(self, linear: torch.nn.Linear, group_size: int = GPTQ_GROUP) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        group = self.in_features if group_size == -1 else group_size
        if group < 1 or self.in_features % group or self.in_features % 8 or self.out_features % 8:
            raise ValueError(
                f"GPTQ 4-bit layer {self.out_features}x{self.in_features} with group size "
                f"{group_size}: expected features divisible by 8 and by the group size"
            )
        self.group_size, groups = group, self.in_features // group
        device = linear.weight.device
        words = torch.empty(
            self.in_features // 8, self.out_features, dtype=torch.int32, device=device
        )
        self.register_buffer("qweight", words)
        zeros = torch.empty(groups, self.out_features // 8, dtype=torch.int32, device=device)
        self.register_buffer("qzeros", zeros)
        scales = torch.empty(groups, self.out_features, dtype=torch.float16, device=device)
        self.register_buffer("scales", scales)
        self.register_buffer(
            "g_idx", torch.empty(self.in_features, dtype=torch.int32, device=device)
        )
        bias = (
            None
            if linear.bias is None
            else torch.empty(self.out_features, dtype=torch.float16, device=device)
        )
        self.register_buffer("bias", bias)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=device).unsqueeze(0)
        self.register_buffer("wf", shifts, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = x.dtype
        zeros = torch.bitwise_right_shift(
            self.qzeros.unsqueeze(2).expand(-1, -1, 8), self.wf.unsqueeze(0)
        ).to(torch.int8)
        zeros = torch.bitwise_and(zeros + 1, 15).reshape(-1, 1, self.out_features)
        scales = self.scales.reshape(-1, 1, self.out_features)
        weight = torch.bitwise_right_shift(
            self.qweight.unsqueeze(1).expand(-1, 8, -1), self.wf.unsqueeze(-1)
        ).to(torch.int8)
        weight = torch.bitwise_and(weight, 15).reshape(-1, self.group_size, self.out_features)
        weight = (scales * (weight - zeros)).reshape(self.in_features, self.out_features)
        out = torch.matmul(x.reshape(-1, self.in_features).half(), weight)
        out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.to(given)


def quantize(
    model: torch.nn.Module,
    kind: str,
    *,
    double_quant: bool = False,
    compute_dtype: torch.dtype | None = None,
    group_size: int = GPTQ_GROUP,
) -> torch.nn.Module:
    """``model`` with each frozen ``nn.Linear`` (but its output embedding) replaced by
    bitsandbytes' ``kind`` (``"8bit"``, ``"nf4"``, ``"fp4"``) as modelled here, in place; for
    ``ga.estimate``'s ``prepare``, after LoRA adapters are added (they stay as they are, and
    a LoRA layer's base clones its output, as PEFT's 4-bit and 8-bit layers do).
    ``compute_dtype``: the 4-bit layers' (default: the replaced weight's dtype). ``"gptq"``:
    auto-gptq's 4-bit layer (``GPTQLinear``) with ``group_size`` (-1: one group), whose LoRA
    layer does not clone the base's output."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    nested = None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child is head or child.weight.requires_grad:
                continue
            if kind == "gptq":
                new: torch.nn.Module = GPTQLinear(child, group_size)
                setattr(parent, name, new)
                continue
            if kind == "8bit":
                new = Quantized8bit(child)
            else:
                if double_quant and nested is None:
                    nested = torch.empty(256, dtype=torch.float32, device=child.weight.device)
                new = Quantized4bit(
                    child,
                    double_quant=double_quant,
                    compute_dtype=compute_dtype or child.weight.dtype,
                    nested_code=nested,
                )
            new.clone_output = hasattr(parent, "lora_A")  # PEFT's LoRA layer over a base
            setattr(parent, name, new)
    return model
