"""The estimate at a micro-batch size read off two traces at other sizes (``at_size``) is
what a trace at that size gives: checked against real traces, on a recipe's GPT and on a
Hugging Face Llama with LoRA, with and without checkpointing, in fp32 and bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.live_tensors import adamw

import gradaccum as ga
from gradaccum.planning.estimate.estimator import at_length, at_size
from gradaccum.planning.estimate.result import Estimate
from gradaccum.planning.estimate.stream import Stream


def gpt():
    from gradaccum.app.recipes import get_recipe

    recipe = get_recipe("gpt")
    return recipe.build_model, recipe.sample_batch, recipe.loss_fn, None


def llama_lora():
    transformers = pytest.importorskip("transformers")
    from gradaccum.integrations import peft

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip

    def build():
        return transformers.LlamaForCausalLM(config)

    def sample(n):
        ids = torch.zeros(n, 24, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    def loss(model, batch):
        out = model(**batch)
        return out.loss * 23 * batch["input_ids"].shape[0], 23 * batch["input_ids"].shape[0]

    return build, sample, loss, lambda m: peft.apply_lora(m, r=4)


MODELS = {"gpt": gpt, "llama-lora": llama_lora}
FIELDS = ("allocated", "reserved", "total", "tensor_peak", "parts", "assumptions")


@pytest.mark.parametrize(
    ("name", "precision", "checkpointing"),
    [
        ("gpt", "fp32", False),
        ("llama-lora", "bf16", True),
        # seconds each: the slow tier keeps make test-fast under a minute
        pytest.param("gpt", "bf16", True, marks=pytest.mark.slow),
        pytest.param("llama-lora", "fp32", False, marks=pytest.mark.slow),
    ],
)
def test_a_size_read_off_two_others_is_the_trace_of_that_size(name, precision, checkpointing):
    build, sample, loss, prepare = MODELS[name]()

    def traced(micro: int, keep: bool = True) -> Estimate:
        return ga.estimate(
            build, adamw, sample, loss, micro_size=micro, micro_batches=2, gpu="a10g",
            precision=precision, checkpointing=checkpointing, prepare=prepare, keep=keep,
        )  # fmt: skip

    two, three = traced(2), traced(3)
    if name == "gpt":
        assert at_size(traced(1), two, 3) is None  # a batch of one is laid out otherwise
    for micro in (5,):
        read = at_size(two, three, micro)
        assert read is not None, f"micro-batch {micro} could not be read off 2 and 3"
        real = traced(micro, keep=False)
        assert real.allocated > three.allocated  # the size matters: not a constant checked
        for field in FIELDS:
            assert getattr(read, field) == getattr(real, field), (micro, field)
        assert read.micro_size == micro and read.seconds == 0.0


def test_a_window_whose_bytes_grow_faster_than_the_batch_is_not_read_off():
    """A similarity matrix of the batch against itself (in-batch negatives) grows with the
    batch squared: no size is read off two others; the trace is the answer."""
    model = lambda: torch.nn.Linear(8, 8)  # noqa: E731

    def loss(m, x):
        e = m(x)
        scores = e @ e.T  # (batch, batch)
        ce = torch.nn.functional.cross_entropy(scores, torch.arange(len(x)), reduction="sum")
        return ce, len(x)

    one, two = (
        ga.estimate(
            model, adamw, lambda n: torch.randn(n, 8), loss, micro_size=n, keep=True, gpu="a10g"
        )  # fmt: skip
        for n in (64, 128)
    )
    assert one.stream.same_window(two.stream)  # the same ops: only the bytes say no
    assert at_size(one, two, 256) is None


def test_a_kept_sequence_reads_back_and_a_damaged_one_is_refused():
    build, sample, loss, _ = gpt()
    est = ga.estimate(build, adamw, sample, loss, micro_size=2, gpu="a10g", keep=True)
    back = Estimate.from_dict(est.to_dict())
    assert back.stream == est.stream and back.total == est.total
    stored = est.stream.to_dict()
    for damage in (
        {"sizes": stored["sizes"] + ",x"},
        {"frees": "999999999"},
        {"order": "f" + stored["order"][1:]},
        {"kinds": "z" * len(stored["kinds"])},
        {"micro_size": 0},
    ):
        with pytest.raises(ValueError, match="allocation sequence is damaged"):
            Stream.from_dict({**stored, **damage})
    other = dataclasses.replace(est.stream, micro_size=4, host=(*est.stream.host, 10**9))
    assert est.stream.grows(other) is None  # not the same window: nothing read off


def hf_blocks(kind: str, layers: int, length: int, lora: bool, width: int = 36):
    """A tiny Llama (LoRA on it) or GPT-2 with eager attention (its matrix grows with the
    length squared) of ``layers`` identical blocks, its sample ``length`` tokens long.
    Their widths are none of the tests' token counts (micro-batch x length): a product of
    the tokens and a weight's gradient of the same shape are not told apart (below)."""
    transformers = pytest.importorskip("transformers")
    from gradaccum.integrations import peft

    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=88, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        build = lambda: transformers.LlamaForCausalLM(config)  # noqa: E731
    else:
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=97,
                                          n_positions=160)  # fmt: skip
        config._attn_implementation = "eager"
        build = lambda: transformers.GPT2LMHeadModel(config)  # noqa: E731

    def sample(n):
        ids = torch.zeros(n, length, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    def loss(model, batch):
        tokens = (length - 1) * batch["input_ids"].shape[0]
        return model(**batch).loss * tokens, tokens

    return build, sample, loss, (lambda m: peft.apply_lora(m, r=4)) if lora else None


@pytest.mark.parametrize(
    ("kind", "precision", "checkpointing", "lora"),
    [
        ("llama", "bf16", True, True),
        # seconds each: the slow tier keeps make test-fast under a minute (GPT-2's eager
        # attention is read exactly in the next test too)
        pytest.param("gpt2", "fp32", False, False, marks=pytest.mark.slow),
        pytest.param("llama", "fp32", False, False, marks=pytest.mark.slow),
        pytest.param("gpt2", "bf16", True, False, marks=pytest.mark.slow),
    ],
)
def test_a_length_read_off_a_smaller_model_is_the_trace_at_that_length(
    kind, precision, checkpointing, lora
):
    """The whole model's estimate at another sequence length, read off its trace at the
    first length and two traces of its 2-block model at both lengths, is what tracing the
    whole model at the other length gives, byte for byte."""

    def traced(layers: int, length: int, micro: int, keep: bool = True) -> Estimate:
        build, sample, loss, prepare = hf_blocks(kind, layers, length, lora)
        return ga.estimate(
            build, adamw, sample, loss, micro_size=micro, micro_batches=2, gpu="a10g",
            precision=precision, checkpointing=checkpointing, prepare=prepare, keep=keep,
        )  # fmt: skip

    for micro, (first, other) in ((1, (40, 64)), (2, (64, 24))):
        whole = traced(5, first, micro)
        read = at_length(whole, traced(2, first, micro), traced(2, other, micro))
        assert read is not None, (micro, first, other)
        real = traced(5, other, micro, keep=False)
        assert real.allocated != whole.allocated  # the length matters: not a constant checked
        for field in FIELDS:
            assert getattr(read, field) == getattr(real, field), (micro, field)


@pytest.mark.slow  # nine traces, seconds: the slow tier keeps make test-fast under a minute
def test_a_length_is_not_read_off_traces_that_do_not_show_it():
    """No reading where the short traces are of other windows (another micro-batch size),
    where the whole model's activations are not among theirs, or where one allocation of
    theirs (an op and a shape) becomes two sizes at the other length: GPT-2 of width 32 at
    2 x 64 tokens makes (128, 32) products of its 128 tokens and the (128, 32) gradient of
    its MLP's output weight, the one growing with the length, the other not; traces at
    another micro-batch size tell them apart (the first grows with it too)."""

    def traced(layers, length, micro, width=40):
        build, sample, loss, _ = hf_blocks("gpt2", layers, length, False, width)
        return ga.estimate(build, adamw, sample, loss, micro_size=micro, micro_batches=2,
                           gpu="a10g", keep=True)  # fmt: skip

    short = traced(2, 24, 2)
    assert at_length(short, short, traced(2, 24, 3)) is None  # another micro-batch size
    gpt_build, gpt_sample, gpt_loss, _ = gpt()  # the gpt recipe's activations: not GPT-2's
    gpt_whole = ga.estimate(gpt_build, adamw, gpt_sample, gpt_loss, micro_size=2, gpu="a10g",
                            keep=True)  # fmt: skip
    assert gpt_whole.stream.resized(short.stream, traced(2, 40, 2).stream) is None
    narrow = [traced(layers, 64, 2, width=32) for layers in (4, 2)]
    assert at_length(*narrow, traced(2, 24, 2, width=32)) is None
    # the two told apart by the micro-batch: traces at 3 show which grows with it
    others = tuple(traced(layers, 64, 3, width=32) for layers in (4, 2))
    read = at_length(*narrow, traced(2, 24, 2, width=32), others=others)
    assert read is not None
    real = traced(4, 24, 2, width=32)
    assert (read.allocated, read.reserved, read.total) == (real.allocated, real.reserved,
                                                           real.total)  # fmt: skip
