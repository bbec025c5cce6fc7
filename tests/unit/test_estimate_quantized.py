"""A frozen 8-bit or 4-bit base modelled as bitsandbytes documents it (bitsandbytes does not
run here, and its kernels never on fake tensors): what each layer holds, worked out by hand
from bitsandbytes' quantize_4bit and Int8Params, and the dequantized weight its training path
allocates in the forward and again in the backward, never saved between them."""

from __future__ import annotations

import pytest
import torch

import gradaccum as ga
from gradaccum.planning.estimate.quantized import quantize
from gradaccum.planning.estimate.trace import Tally, fake_mode


class Adapted(torch.nn.Module):
    """A frozen base layer and a trainable one after it (as LoRA leaves a model)."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(256, 512)
        self.head = torch.nn.Linear(512, 8)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.base(x)))


def sample(n):
    return torch.randn(n, 256), torch.randint(0, 8, (n,))


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), y.numel()


N = 256 * 512  # the base's weight, in values
HEAD = (512 * 8 + 8) * 4  # the trainable layer, float32
BIAS = 512 * 4
# bitsandbytes' layout, by hand: packed 4-bit values two a byte; a float32 absmax per 64
# values and a 16-entry float32 code per layer; double quantization: uint8 absmax, a float32
# absmax per 256 of them, a 0-d float32 offset, the shared 256-entry float32 map; 8-bit: int8
# values and a float32 scale per output row
HELD = {
    ("nf4", False): N // 2 + (N // 64) * 4 + 16 * 4,
    ("fp4", False): N // 2 + (N // 64) * 4 + 16 * 4,
    ("nf4", True): N // 2 + N // 64 + (N // 64 // 256) * 4 + 4 + 256 * 4 + 16 * 4,
    ("8bit", False): N + 512 * 4,
}


@pytest.mark.parametrize(("kind", "double"), list(HELD))
def test_a_quantized_layer_holds_its_documented_layout(kind, double):
    def build():
        return quantize(Adapted(), kind, double_quant=double)

    adamw = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    est = ga.estimate(build, adamw, sample, loss, micro_size=4, device="cpu")
    assert est.parts["parameters"] == HELD[(kind, double)] + BIAS + HEAD
    # the base is frozen: AdamW's state is the head's two moments and two step counters
    assert est.parts["optimizer state"] == 2 * HEAD + 2 * 4


@pytest.mark.parametrize("kind", ["nf4", "8bit"])
def test_the_weight_is_dequantized_in_the_forward_and_again_in_the_backward(kind):
    with fake_mode():
        model = quantize(Adapted(), kind)
        x = torch.randn(4, 256, requires_grad=True)  # as a LoRA layer's input needs its grad
        tally = Tally()
        with tally:
            model(x).sum().backward()
    dequantized = N * 4  # the float32 weight, out x in
    allocs = [size for action, _, size in tally.events if action == "alloc"]
    # 4-bit: in the compute dtype in both passes; 8-bit: as an int8 product forward, the
    # weight in the input's dtype backward
    assert allocs.count(dequantized) == (2 if kind == "nf4" else 1)
    live = tally.live_at(len(tally.events))
    assert dequantized not in live.values()  # neither kept


def test_the_output_embedding_and_trainable_layers_stay_as_they_are():
    model = quantize(Adapted(), "nf4")
    assert type(model.base).__name__ == "Quantized4bit" and type(model.head) is torch.nn.Linear
    with pytest.raises(ValueError, match="kind must be one of 8bit, nf4, fp4"):
        quantize(Adapted(), "int4")


def test_a_4bit_layer_keeps_its_input_to_the_backward_as_matmul4bit_does():
    """bitsandbytes' MatMul4Bit keeps A (ctx.tensors = (A, B)) whenever A needs a gradient,
    though its backward reads only the weight: the input lives until the backward, and is
    let go of with the graph; an input that needs no gradient is not kept."""
    import weakref

    from gradaccum.planning.estimate.quantized import Quantized4bit

    layer = Quantized4bit(torch.nn.Linear(16, 16), double_quant=False,
                          compute_dtype=torch.float32, nested_code=None)  # fmt: skip
    h = torch.randn(4, 16, requires_grad=True) * 2  # an activation, made by an op
    kept = weakref.ref(h.untyped_storage())
    out = layer(h)
    del h
    assert kept() is not None  # held by the layer's backward context
    out.sum().backward()
    del out
    assert kept() is None
    h = torch.randn(4, 16) * 2
    kept = weakref.ref(h.untyped_storage())
    layer(h)
    del h
    assert kept() is None


def test_a_gptq_layer_holds_auto_gptqs_packed_buffers_counted_by_hand():
    """Linear(256, 512) with a bias at group size 128: qweight 32 x 512 int32 (65,536 B),
    qzeros 2 x 64 int32 (512 B), scales 2 x 512 float16 (2,048 B), g_idx 256 int32 (1,024 B),
    the bias 512 float16 (1,024 B); and the shift table (8 int32, not saved)."""
    from gradaccum.planning.estimate.quantized import GPTQLinear

    layer = GPTQLinear(torch.nn.Linear(256, 512), group_size=128)
    held = {name: b.untyped_storage().nbytes() for name, b in layer.named_buffers()}
    assert held == {"qweight": 65_536, "qzeros": 512, "scales": 2_048, "g_idx": 1_024,
                    "bias": 1_024, "wf": 32}  # fmt: skip
    assert "wf" not in layer.state_dict()
    with pytest.raises(ValueError, match="group size 100: expected features divisible"):
        GPTQLinear(torch.nn.Linear(256, 512), group_size=100)


def test_a_gptq_layer_keeps_its_dequantized_float16_weight_for_the_backward():
    """auto-gptq's torch path: matmul(x.half(), weight) with a weight that needs no gradient
    keeps the float16 (in, out) weight for the input's gradient, and nothing when the input
    needs none either."""
    from gradaccum.planning.estimate.quantized import GPTQLinear

    layer = GPTQLinear(torch.nn.Linear(64, 32, bias=False), group_size=-1)
    for needs, expected in ((True, [(torch.float16, (64, 32))]), (False, [])):
        saved = []

        def pack(t, saved=saved):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        x = torch.randn(4, 64, requires_grad=needs)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        assert [s for s in saved if s[1] == (64, 32)] == expected
