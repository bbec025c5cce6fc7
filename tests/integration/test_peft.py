"""gradaccum.integrations.peft with real PEFT and transformers: LoRA trains only its adapters,
exactly; each save loads back as the model that was trained; the planner counts no gradient
or optimizer state for frozen weights. Every model is tiny and built here (the integrations'
GPT-2 from tests/frameworks.py, mostly); nothing is downloaded."""

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from frameworks import VOCAB, padded_sequences, stack, tiny_gpt2
from helpers import TinyLM, max_rel_err, params
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import gradaccum as ga
from gradaccum.integrations.peft import (
    apply_lora,
    save_adapter,
    save_full,
    save_merged,
    trainable_summary,
)
from gradaccum.memory import TrainingMemory, tensor_bytes

LORA_R = 8


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """Saved pretrained weights, as a user's local model folder holds them."""
    folder = tmp_path_factory.mktemp("base")
    tiny_gpt2().save_pretrained(folder)
    return folder


def load(folder) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder)


def token_batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` sequences of lengths 4..64, right-padded; padding masked and labelled -100."""
    return stack(padded_sequences(n, seed))


def loss_fn(model, mb):
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])
    return ga.causal_lm_loss(out.logits, mb["labels"])


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train(model, windows: int = 3, lr: float = 1e-2) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(trainable(model), lr=lr)
    acc = ga.Accumulator(model, optimizer)
    for w in range(windows):
        assert acc.step(ga.split(token_batch(8, seed=w), 2), loss_fn).stepped
    return optimizer


@torch.no_grad()
def logits(model) -> torch.Tensor:
    model.eval()
    batch = token_batch(6, seed=100)
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def word_tokenizer():
    """A real Hugging Face tokenizer, built here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")


@pytest.fixture(scope="module")
def trained(base_dir):
    """LoRA r=8 on the saved GPT-2, trained a few windows, its adapters non-trivial."""
    model = apply_lora(load(base_dir), r=LORA_R)
    train(model)
    return model


# -- training ------------------------------------------------------------------------------------


def test_lora_trains_the_adapters_and_leaves_every_base_weight_bitwise_unchanged(base_dir):
    model = apply_lora(load(base_dir), r=LORA_R)
    model.train()
    before = params(model)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters == {n for n in before if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 4  # A and B on c_attn in each of the 2 blocks

    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    with_grad_at_step = []  # every model parameter holding a gradient when the optimizer steps
    optimizer.register_step_pre_hook(
        lambda *_: with_grad_at_step.append(
            {n for n, p in model.named_parameters() if p.grad is not None}
        )
    )
    acc = ga.Accumulator(model, optimizer)
    for w in range(3):
        acc.step(ga.split(token_batch(8, seed=w), 2), loss_fn)

    assert with_grad_at_step == [adapters] * 3
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in optimizer.state} == adapters
    for name, p in model.named_parameters():
        if name in adapters:
            assert not torch.equal(p, before[name]), f"{name} did not train"
        else:
            assert torch.equal(p, before[name]), f"frozen {name} changed"


def test_the_window_gradient_of_the_adapters_is_the_full_batch_gradient(base_dir):
    """32 padded sequences in 8 micro-batches through the Accumulator against one backward
    of the token-mean loss over the whole batch, written with torch alone, in float64: two
    float32 computations of this gradient (one micro-batch of all 32 among them) differ by
    nearly the bound, so the window's is held to the exact gradient instead."""
    torch.manual_seed(0)  # A's initialization, whatever ran before
    model = apply_lora(load(base_dir), r=LORA_R)
    with torch.no_grad():  # B starts at zero, which makes A's gradient zero: give it values
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.train()
    reference_model = copy.deepcopy(model).double()
    items = padded_sequences(32, seed=7)

    optimizer = torch.optim.AdamW(trainable(model), lr=0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    handed = {}
    optimizer.register_step_pre_hook(
        lambda opt, *_: handed.update(
            {names[id(p)]: p.grad.clone() for grp in opt.param_groups for p in grp["params"]}
        )
    )
    micro_batches = ga.split(stack(items), 4)
    assert len(micro_batches) == 8
    ga.Accumulator(model, optimizer).step(micro_batches, loss_fn)

    batch = stack(items)
    out = reference_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    (loss / (labels != -100).sum()).backward()
    expected = {n: p.grad for n, p in reference_model.named_parameters() if p.grad is not None}
    assert expected.keys() == handed.keys() and len(expected) == 4
    assert all(g.abs().sum() > 0 for g in expected.values())
    err = max_rel_err(handed, expected)
    print(f"adapter gradients, 8 micro-batches vs the full batch: max relative error {err:.2e}")
    assert err <= 1e-6


# -- saving ----------------------------------------------------------------------------------


def test_a_saved_adapter_on_a_freshly_loaded_base_gives_the_trained_models_logits(
    trained, base_dir, tmp_path
):
    folder = save_adapter(trained, tmp_path / "adapter")
    assert (folder / "adapter_model.safetensors").is_file()
    assert (folder / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(load(base_dir), folder)
    diff = max_abs(logits(loaded), logits(trained))
    print(f"adapter reloaded on a fresh base: max |logits difference| {diff:.2e}")
    assert diff <= 1e-6


def test_a_merged_save_loads_without_peft_and_the_trained_model_keeps_its_adapters(
    trained, tmp_path
):
    before, trained_logits = params(trained), logits(trained)
    folder = save_merged(trained, tmp_path / "merged", tokenizer=word_tokenizer())
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and not any("lora" in k for k in keys)
    merged = load(folder)
    assert not isinstance(merged, PeftModel)
    diff = max_abs(logits(merged), trained_logits)
    print(f"merged model reloaded: max |logits difference| {diff:.2e}")
    assert diff <= 1e-5
    assert AutoTokenizer.from_pretrained(folder)("hello world")["input_ids"] == [1, 2]
    # the merge ran on a copy: the training model is exactly what it was, adapters included
    assert isinstance(trained, PeftModel)
    assert params(trained).keys() == before.keys()
    assert all(torch.equal(p, before[n]) for n, p in trained.named_parameters())
    assert torch.equal(logits(trained), trained_logits)


def test_a_full_fine_tune_saves_in_hugging_faces_format(base_dir, tmp_path):
    model = load(base_dir)
    train(model, windows=2)
    folder = save_full(model, tmp_path / "full", tokenizer=word_tokenizer())
    assert (folder / "model.safetensors").is_file()
    diff = max_abs(logits(load(folder)), logits(model))
    print(f"full fine-tune reloaded: max |logits difference| {diff:.2e}")
    assert diff <= 1e-6
    assert AutoTokenizer.from_pretrained(folder)("world hello")["input_ids"] == [2, 1]


def test_a_failed_save_leaves_the_previous_folder_whole_and_nothing_beside_it(base_dir, tmp_path):
    first, second = load(base_dir), load(base_dir)
    train(second, windows=1)
    folder = save_full(first, tmp_path / "out")
    with pytest.raises(AttributeError):  # the model is written, then the tokenizer fails
        save_full(second, folder, tokenizer=object())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(logits(load(folder)), logits(first))
    save_full(second, folder)  # a whole new version replaces the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(logits(load(folder)), logits(second))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="a_file: it is a file, not a folder"):
        save_full(second, tmp_path / "a_file")
    with pytest.raises(TypeError, match="save_adapter needs a model with LoRA adapters"):
        save_adapter(first, tmp_path / "adapter")


# -- arguments and defaults ----------------------------------------------------------------------


def test_every_bad_lora_argument_is_reported_at_once(base_dir):
    model = load(base_dir)
    with pytest.raises(ValueError) as err:
        apply_lora(model, r=0, alpha=-1, dropout=1.5)
    msg = str(err.value)
    assert msg.startswith("cannot apply LoRA: ") and "\n" not in msg
    for part in (
        "r must be an integer >= 1, got 0",
        "alpha must be a positive number or None (2 * r), got -1",
        "dropout must be a fraction in [0, 1), got 1.5",
    ):
        assert part in msg
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_a_model_without_a_known_target_is_refused_with_its_type_and_layers():
    from transformers import MambaConfig, MambaForCausalLM

    def mamba():  # a causal LM without attention
        torch.manual_seed(0)
        config = MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, state_size=4)
        return MambaForCausalLM(config)

    with pytest.raises(ValueError) as err:
        apply_lora(mamba(), r=4)
    msg = str(err.value)
    assert "no default LoRA target for model type 'mamba' (MambaForCausalLM)" in msg
    assert "(dt_proj, in_proj, lm_head, out_proj, x_proj); pass targets=[...]" in msg
    assert "\n" not in msg
    adapted = apply_lora(mamba(), r=4, targets=["in_proj", "x_proj"])
    assert adapted_layers(adapted) == {"in_proj", "x_proj"}
    with pytest.raises(TypeError, match="needs a Hugging Face causal LM .*, got TinyLM"):
        apply_lora(TinyLM(), r=4, targets=["qkv"])


def adapted_layers(model) -> set[str]:
    """The names of the layers that carry a trainable adapter."""
    return {
        n.split(".lora_")[0].split(".")[-1] for n, p in model.named_parameters() if p.requires_grad
    }


def _tiny(model_type: str) -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model_type == "gpt2":
        return tiny_gpt2()
    sizes = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    if model_type == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes))
    return GPTNeoXForCausalLM(GPTNeoXConfig(**sizes))


@pytest.mark.parametrize(
    "model_type, targets",
    [("gpt2", {"c_attn"}), ("llama", {"q_proj", "v_proj"}), ("gpt_neox", {"query_key_value"})],
)
def test_default_targets_are_the_attention_projections(model_type, targets):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_lora(_tiny(model_type), r=4)
    assert adapted_layers(model) == targets
    config = model.peft_config["default"]
    assert config.lora_alpha == 8 and config.r == 4  # alpha defaults to 2 * r
    assert config.fan_in_fan_out == (model_type == "gpt2")  # Conv1D's transposed weight
    # said up front, so PEFT need not flip the flag itself with a warning per layer
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)]


def test_the_summary_counts_the_adapters_against_every_parameter(base_dir):
    model = load(base_dir)
    base = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    assert trainable_summary(model) == f"trainable parameters: {base:,} of {base:,} (100.00%)"
    adapted = apply_lora(model, r=LORA_R)
    # per block: A (64 -> 8) and B (8 -> 3 * 64) on c_attn
    lora = 2 * (64 * LORA_R + LORA_R * 3 * 64)
    share = 100 * lora / (base + lora)
    assert trainable_summary(adapted) == (
        f"trainable parameters: {lora:,} of {base + lora:,} ({share:.2f}%)"
    )


def test_importing_gradaccum_imports_neither_peft_nor_transformers():
    code = (
        "import sys, gradaccum, gradaccum.integrations.peft; "
        "print(sorted(m for m in ('peft', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# -- planning ------------------------------------------------------------------------------


@pytest.mark.slow  # 8 s of planning: make test-fast keeps its minute
def test_the_planner_counts_no_gradient_or_optimizer_state_for_frozen_weights(base_dir):
    """Two plans of the same GPT-2, same batch and budget: a full fine-tune and LoRA r=8,
    each with AdamW over its trainable parameters, measured by live tensor bytes."""
    sample = token_batch(16, seed=0)
    sample["attention_mask"][:] = 1  # the largest shape: no padding
    planned, models = {}, {}
    for kind in ("full", "lora"):
        model = load(base_dir)
        if kind == "lora":
            model = apply_lora(model, r=LORA_R)
        optimizer = torch.optim.AdamW(trainable(model), lr=1e-3)
        planned[kind] = ga.plan(
            model,
            optimizer,
            sample,
            loss_fn,
            effective_batch=16,
            budget="12MB",
            meter="tensors",
            probe_sizes=[1, 2],
        )
        models[kind] = model
    full, lora = planned["full"], planned["lora"]

    # Independently: every parameter's fp32 bytes are resident; AdamW keeps exp_avg and
    # exp_avg_sq (fp32, each the parameter's size) and a 0-dim fp32 step per trainable tensor.
    for kind, p in planned.items():
        model = models[kind]
        expected_static = (
            4 * sum(q.numel() for q in model.parameters())
            + sum(b.numel() * b.element_size() for b in model.buffers())
            + sum(8 * q.numel() + 4 for q in trainable(model))
        )
        assert p.static_bytes == expected_static, kind
        # what a window holds whatever its size: the gradients of the trainable weights
        grads = 4 * sum(q.numel() for q in trainable(model))
        assert abs(p.peak_fit.intercept - grads) <= 0.05 * grads + 4096, (kind, p.peak_fit)

    frozen = sum(p.numel() for n, p in models["lora"].named_parameters() if not p.requires_grad)
    assert frozen == sum(p.numel() for p in models["full"].parameters())
    frozen_bytes = 3 * 4 * frozen  # AdamW's two states and the gradient, fp32
    micro = lora.micro_size
    diff = full.predict(micro) - lora.predict(micro)
    print(
        f"micro-batch {micro}: full fine-tune predicts {full.predict(micro):,.0f} B, LoRA "
        f"{lora.predict(micro):,.0f} B, difference {diff:,.0f} B; frozen weights' gradients "
        f"and AdamW state {frozen_bytes:,} B (planned micro-batches: full {full.micro_size}, "
        f"LoRA {lora.micro_size})"
    )
    assert diff >= frozen_bytes

    # The LoRA plan against a real training run at its micro-batch, counted as plan's
    # verification and `gradaccum.app.measure` count it: parameters and buffers, plus the live
    # tensor bytes from before the first step (optimizer state included).
    model = apply_lora(load(base_dir), r=LORA_R)
    acc = ga.Accumulator(model, torch.optim.AdamW(trainable(model), lr=1e-3))
    memory = TrainingMemory(model, "cpu", "tensors")
    for _ in range(2):
        acc.step(ga.split(sample, micro), loss_fn)
    measured = memory.peak()
    print(
        f"LoRA at micro-batch {micro} x {lora.micro_batches}: predicted peak "
        f"{lora.predicted_peak:,.0f} B, line {lora.predict(micro):,.0f} B, measured "
        f"{measured:,} B; optimizer state {tensor_bytes(acc.optimizer.state_dict()['state']):,} B"
    )
    for prediction in (lora.predicted_peak, lora.predict(micro)):
        assert abs(prediction - measured) <= 0.15 * measured
