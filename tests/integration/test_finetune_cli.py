"""`gradaccum train --hf-model PATH --data FILE --lora R`: a tiny GPT-2 with saved weights and
its own tokenizer (made here), LoRA adapters trained on a .jsonl of prompt/completion pairs,
and weights exported where other tools load them."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import cli, run_lines, sigterm_then_resume_matches

from gradaccum.app.folder import THIRD_PARTY

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny GPT-2 and a byte-level BPE tokenizer trained on a stdlib file, saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([open(json.__file__).read()], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(fast),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=fast.eos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "qa.jsonl"
    rows = [{"prompt": f"def f{i}(x):", "completion": f" return x + {i % 7}"} for i in range(160)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


LORA = ["--lora", 8, "--effective-batch", 32, "--micro-batch", 4, "--seq-len", 32]
LORA += ["--lr", 0.03, "--warmup-steps", 0, "--eval-every", 4, "--checkpoint-every", 100]


metrics = run_lines


def trained_model(base, run, lora: bool):
    """The model as the run left it: the base, LoRA applied as the run applied it, and the
    checkpoint's weights."""
    from gradaccum.integrations.peft import apply_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    if lora:
        model = apply_lora(model, 8)
    state = torch.load(run / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    model.load_state_dict(state)
    return model.eval(), state


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def lora_args(base, data) -> list:
    return ["--hf-model", base, "--data", data, *LORA, "--steps", 16, "--merge-lora"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base, data):
    """One LoRA run, 16 steps, exporting at step 8 and at the end; two tests read it."""
    run = tmp_path_factory.mktemp("lora") / "run"
    proc = cli("train", *lora_args(base, data), "--export-every", 8, "--out", run)
    return run, proc.stdout, proc.stderr


def test_a_fine_tuning_run_says_nothing_of_other_packages(lora_run):
    """DeepSpeed, installed and unused, said "Setting accelerator to CPU" as transformers
    imported it to save the export; transformers drew loading and saving progress bars; PEFT
    set off a FutureWarning of transformers'. None of it is about the run: it is kept in the
    run folder's third_party.log, not lost."""
    run, stdout, stderr = lora_run
    said = stdout + stderr
    for chatter in ("Setting accelerator", "Loading weights", "Writing model shards", "it/s]"):
        assert chatter not in said, (chatter, said[-3000:])
    assert "Warning" not in stderr, stderr
    if importlib.util.find_spec("deepspeed") is not None:  # it speaks only when installed
        kept = (run / THIRD_PARTY).read_text()
        assert "DeepSpeed WARNING: Setting accelerator to" in kept, kept


def test_lora_trains_only_the_adapters_and_exports_what_peft_loads(base, lora_run):
    run, stdout, _ = lora_run
    assert stdout.count("exported ") == 2, stdout  # at step 8 and at the end
    model, state = trained_model(base, run, lora=True)

    pretrained = load_file(base / "model.safetensors")
    frozen = {
        k.removeprefix("base_model.model.").replace(".base_layer", ""): v
        for k, v in state.items()
        if "lora_" not in k
    }
    assert frozen.keys() >= pretrained.keys()
    assert all(torch.equal(frozen[k], pretrained[k]) for k in pretrained)  # bitwise unchanged
    assert any("lora_" in k for k in state)

    ids = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    fresh = transformers.AutoModelForCausalLM.from_pretrained(base)
    loaded = peft.PeftModel.from_pretrained(fresh, run / "export" / "adapter").eval()
    assert float((logits(loaded, ids) - logits(model, ids)).abs().max()) <= 1e-6
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "export" / "merged").eval()
    assert float((logits(merged, ids) - logits(model, ids)).abs().max()) <= 1e-5
    assert (run / "export" / "merged" / "tokenizer.json").is_file()

    held_out = [m["eval_loss"] for m in metrics(run) if "eval_loss" in m]
    print(f"held-out loss per 4 steps: {held_out}")
    assert held_out[-1] < held_out[0]


@pytest.mark.slow
def test_lora_resumes_after_sigterm_bitwise(tmp_path, base, data, lora_run):
    args = [*lora_args(base, data), "--export-every", 8]
    sigterm_then_resume_matches(tmp_path, args, stop_after=3, steps=16, straight=lora_run[0])


@pytest.mark.slow
def test_a_full_fine_tune_exports_a_model_transformers_loads(tmp_path, base, data):
    run = tmp_path / "run"
    args = ["--effective-batch", 32, "--micro-batch", 8, "--seq-len", 32, "--steps", 2]
    cli("train", "--hf-model", base, "--data", data, *args, "--out", run)
    model, _ = trained_model(base, run, lora=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(run / "export" / "model").eval()
    ids = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(exported, ids), logits(model, ids))
    assert (run / "export" / "model" / "model.safetensors").is_file()
    assert (run / "export" / "model" / "tokenizer.json").is_file()


def test_an_effective_batch_of_256_plans_as_8_or_more_micro_batches_and_stays_exact(base, data):
    """LoRA on the saved base, 256 sequences per step under a budget one 256-sequence batch
    does not fit: the plan's window, then its first gradient against one float64 full-batch
    backward written with torch alone."""
    import copy

    import torch.nn.functional as F

    import gradaccum as ga
    from gradaccum.app.recipes import hf_recipe
    from gradaccum.app.recipes.userdata import load_sequences
    from gradaccum.integrations.peft import apply_lora

    recipe = hf_recipe(str(base))
    loaded = load_sequences(data, recipe.encoder(), seq_len=32, eval_fraction=0, seed=0)
    ids, labels = loaded["train"]
    rows = torch.arange(256) % len(ids)
    batch = {"input_ids": ids[rows], "labels": labels[rows]}
    torch.manual_seed(0)
    model = apply_lora(transformers.AutoModelForCausalLM.from_pretrained(base), 8)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.0)
    sample = {k: v[:8] for k, v in batch.items()}

    def planned(budget):
        return ga.plan(
            model,
            optimizer,
            sample,
            recipe.loss_fn,
            effective_batch=256,
            budget=budget,
            meter="tensors",
        )

    roomy = planned("1GiB")
    budget = int(roomy.predict(24) / (1 - roomy.margin))
    tight = planned(budget)
    print(tight.summary())
    assert tight.micro_batches >= 8, tight.summary()
    assert tight.predict(256) > budget  # the whole batch at once does not fit

    reference = copy.deepcopy(model).double()
    logits = reference(input_ids=batch["input_ids"]).logits
    shifted = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), shifted.reshape(-1), reduction="sum"
    )
    (loss / (shifted != -100).sum()).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    names = {id(p): n for n, p in model.named_parameters()}
    seen = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]}
        )
    )
    acc = ga.Accumulator(model, optimizer)
    result = acc.step(ga.split(batch, tight.micro_size), recipe.loss_fn)
    assert result.micro_batches == tight.micro_batches
    # One vector over the adapters (LoRA's A gets an exactly zero gradient while B is zero).
    diff = sum(float((seen[0][k].double() - want[k]).square().sum()) for k in want)
    err = (diff / sum(float(want[k].square().sum()) for k in want)) ** 0.5
    print(f"first window, {result.micro_batches} micro-batches: relative error {err:.1e}")
    assert seen[0].keys() == want.keys() and err <= 1e-6

    for group in optimizer.param_groups:
        group["lr"] = 1.0
    losses = [acc.step(ga.split(batch, tight.micro_size), recipe.loss_fn).loss for _ in range(2)]
    assert losses[-1] < losses[0], losses  # and it trains


@pytest.mark.slow
def test_a_lora_target_the_model_lacks_leaves_no_folder_and_the_fixed_command_trains(
    tmp_path, base, data
):
    """A failed start after the folder was made (the model is built only then): one line,
    the folder gone, and the same command with the targets fixed trains in it."""
    run = tmp_path / "run"
    args = ["train", "--hf-model", base, "--data", data, *LORA, "--steps", 1, "--out", run]
    proc = cli(*args, "--lora-targets", "no_such_layer", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    *_, line = proc.stderr.strip().splitlines()  # (after transformers' loading bar)
    assert line.startswith("gradaccum: error: ") and "no_such_layer" in line, line
    assert not run.exists()
    cli(*args, "--lora-targets", "c_attn")
    assert [x["step"] for x in metrics(run)] == [1]


_LOAD_ELSEWHERE = """
import sys
import torch, transformers, peft
adapter, merged, ids_file, out_file = sys.argv[1:]
ids = torch.load(ids_file, weights_only=True)
tok = transformers.AutoTokenizer.from_pretrained(adapter)
assert tok("def f(x):")["input_ids"]
with_adapter = peft.AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
plain = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
assert transformers.AutoTokenizer.from_pretrained(merged)("x")["input_ids"]
with torch.no_grad():
    out = {"adapter": with_adapter(input_ids=ids).logits, "merged": plain(input_ids=ids).logits}
    prompt = torch.tensor([tok("def f(x):")["input_ids"]])
    for name, model in (("adapter", with_adapter), ("merged", plain)):
        made = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False)
        assert made.shape[1] == prompt.shape[1] + 5, made.shape
torch.save(out, out_file)
"""


@pytest.mark.slow
def test_exports_of_a_model_named_by_a_relative_path_load_from_anywhere_offline(
    tmp_path, base, data
):
    """--hf-model given relative to the working directory (as a user types it): the adapter
    and the merged model, each with its tokenizer, load in another process from another
    working directory with the hub shut, generate, and give the in-run model's logits."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    args = [*LORA, "--steps", 2, "--merge-lora", "--data", data, "--out", run]
    cli("train", "--hf-model", base.name, *args, cwd=base.parent)
    adapter, merged = run / "export" / "adapter", run / "export" / "merged"
    assert (adapter / "tokenizer.json").is_file() and (merged / "tokenizer.json").is_file()
    said = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(said) and os.path.samefile(said, base), said

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    offline["OMP_NUM_THREADS"] = "1"
    files = [adapter, merged, tmp_path / "ids.pt", tmp_path / "out.pt"]
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_ELSEWHERE, *map(str, files)],
        cwd=elsewhere,
        env=offline,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    model, _ = trained_model(base, run, lora=True)
    want = logits(model, ids)
    assert float((loaded["adapter"] - want).abs().max()) <= 1e-5
    assert float((loaded["merged"] - want).abs().max()) <= 1e-5


@pytest.fixture(scope="module")
def deep(tmp_path_factory, base):
    """A GPT-2 of 32 blocks over 256 positions (the tiny base's tokenizer): one sequence's
    activations are several times what its blocks keep under recomputation."""
    folder = tmp_path_factory.mktemp("deep-gpt2")
    fast = transformers.AutoTokenizer.from_pretrained(base)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(fast), n_positions=256, n_embd=64, n_layer=32, n_head=4,
        bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_checkpointing_auto_plans_with_recomputation_where_only_it_fits(tmp_path, deep):
    """At a budget between the whole run's measured need at one sequence per micro-batch
    without recomputation and with it, --checkpointing auto plans with it and the run,
    evaluations, checkpoints and export included, stays within the budget; off is refused,
    naming --checkpointing auto."""
    import json as jsonlib

    from gradaccum.memory import parse_bytes

    text = tmp_path / "text.txt"
    text.write_text(open(jsonlib.__file__).read() * 2)
    args = ["train", "--hf-model", deep, "--data", text, "--seq-len", 256, "--no-noise-scale",
            "--effective-batch", 8, "--steps", 2, "--eval-every", 1]  # fmt: skip

    def need(checkpointing: str) -> float:
        """The run itself at one sequence per micro-batch, unplanned: its measured peak.
        (Needs read from plans of smaller runs missed this one's summed gradient and
        batch, and a plan's own error would sit on both sides of the band.)"""
        out = tmp_path / f"need-{checkpointing}"
        cli(*args, "--micro-batch", 1, "--checkpointing", checkpointing, "--out", out)
        return jsonlib.loads((out / "memory.json").read_text())["peak"]

    off, on = need("off"), need("on")
    print(f"one sequence's run needs {off / 2**20:.1f} MiB, {on / 2**20:.1f} MiB recomputing")
    assert on < 0.75 * off  # a band wide enough for the plan's error on either side
    usable = (on + off) / 2
    budget = f"{int(usable / (1 - 0.15))}B"
    args += ["--budget", budget]
    refused = cli(*args, "--out", tmp_path / "off", check=False)
    assert refused.returncode == 2 and "--checkpointing auto" in refused.stderr, refused.stderr
    cli(*args, "--checkpointing", "auto", "--out", tmp_path / "auto")
    plan = jsonlib.loads((tmp_path / "auto" / "plan.json").read_text())
    assert plan["checkpointing"] is True and plan["checkpointed_blocks"]
    memory = jsonlib.loads((tmp_path / "auto" / "memory.json").read_text())
    assert {"training", "evaluation", "checkpoint", "export"} <= set(memory["phases"])
    assert memory["peak"] <= parse_bytes(budget), (memory, budget)
