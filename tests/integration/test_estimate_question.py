"""`gradaccum plan --device cuda --hf-model DIR` as a new user asks it (issue 56): with
activation checkpointing, "auto", the card's memory as the budget, a refusal that says what
would fit, an adapter config, an export, and every bad config or trace ending in one line.
Tiny Llama- and GPT-2-shaped configs the tests write; the trace in its own process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_faults import in_process, one_line

from gradaccum.planning.estimate.devices import GPUS

pytestmark = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="with a GPU here, --device cuda measures"
)


def llama(folder, **extra):
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        **extra,
    }
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def gpt2(folder):
    config = {"model_type": "gpt2", "n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 128,
              "n_positions": 256}  # fmt: skip
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "cache"))


def estimate(*args):
    done = in_process("plan", "--device", "cuda", *map(str, args), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("shape", [llama, gpt2])
def test_checkpointing_on_and_auto_are_estimated_for_cuda(tmp_path, shape):
    """It ended in 'CheckpointError: A different number of tensors was saved' for every
    model; auto never tried checkpointing."""
    model = shape(tmp_path / "model")
    common = ("--hf-model", model, "--seq-len", 128, "--precision", "bf16", "--effective-batch", 8)
    plain = estimate(*common, "--micro-batch", 4)
    on = estimate(*common, "--micro-batch", 4, "--checkpointing", "on")
    assert on["parts"]["activations"] < plain["parts"]["activations"]
    assert on["checkpointing"] is True and plain["checkpointing"] is False
    # auto, with a budget between the two: the largest of each said, the one that fits chosen
    budget = (plain["total"] + on["total"]) // 2
    auto = estimate(*common, "--checkpointing", "auto", "--budget", f"{budget}B")
    said = " ".join(auto["checkpointing_said"])
    assert "without it, up to micro-batch" in said and "with it, up to micro-batch" in said
    assert auto["total"] <= budget


def test_a_refusal_shows_the_breakdown_and_only_changes_not_made(tmp_path):
    model = llama(tmp_path / "model", hidden_size=256, intermediate_size=512, vocab_size=4096)
    done = in_process("plan", "--device", "cuda", "--hf-model", model, "--gpu", "t4",
                      "--seq-len", 256, "--checkpointing", "on", "--lora", 4,
                      "--budget", "400MB")  # fmt: skip
    assert done.returncode == 2, done.stderr
    text = done.stdout
    for row in ("parameters", "gradients", "optimizer state", "activations", "temporaries",
                "reserved (max_memory_reserved)", "CUDA context", "device total"):  # fmt: skip
        assert row in text, row
    offered = [line.split(":")[0].strip() for line in text.splitlines() if line.startswith("  --")]
    assert "--precision bf16" in offered and "--quantize nf4" in offered
    assert "--seq-len 128" in offered
    assert not any(flag.startswith(("--checkpointing", "--lora")) for flag in offered), offered
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("gradaccum: error: the estimate at micro-batch 1 is ")
    assert "over the budget (--budget 400MB: 0.4 GB (0.4 GiB))" in error


def test_the_cards_memory_is_the_budget_unless_one_is_given(tmp_path):
    model = llama(tmp_path / "model")
    card = estimate("--hf-model", model, "--gpu", "t4", "--seq-len", 32, "--micro-batch", 1)
    assert card["budget"] == GPUS["t4"].memory
    given = estimate("--hf-model", model, "--gpu", "t4", "--seq-len", 32, "--micro-batch", 1,
                     "--budget", "1GB")  # fmt: skip
    assert given["budget"] == 10**9
    text = in_process("plan", "--device", "cuda", "--hf-model", model, "--gpu", "t4",
                      "--seq-len", 32, "--micro-batch", 1).stdout  # fmt: skip
    assert "fits the budget (t4's memory, 16.1 GB (15.0 GiB))" in text


def test_an_adapter_config_is_estimated_as_users_configure_lora(tmp_path):
    pytest.importorskip("peft")
    model = llama(tmp_path / "model")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
        "target_modules": "all-linear", "modules_to_save": ["embed_tokens"],
        "inference_mode": True, "task_type": "CAUSAL_LM",
    }))  # fmt: skip
    common = ("--hf-model", model, "--seq-len", 32, "--micro-batch", 2)
    ranked = estimate(*common, "--lora", 8)
    configured = estimate(*common, "--lora", adapter)
    said = " ".join(configured["assumptions"])
    assert "r=8, alpha=16" in said and "all-linear" in said and "embed_tokens" in said
    # all the linear layers' adapters and a whole embedding train: more state than q/v's
    assert configured["parts"]["optimizer state"] > 2 * ranked["parts"]["optimizer state"]


@pytest.mark.parametrize("framework", ["transformers", "deepspeed"])
def test_export_from_an_estimate_is_the_frameworks_file(tmp_path, framework):
    model = llama(tmp_path / "model")
    file = tmp_path / f"{framework}.json"
    done = in_process("plan", "--device", "cuda", "--hf-model", model, "--seq-len", 32,
                      "--effective-batch", 16, "--checkpointing", "on",
                      "--export", framework, "--export-to", file)  # fmt: skip
    assert done.returncode == 0, done.stderr
    micro = int(done.stdout.split("micro-batch ")[1].split()[0])
    if framework == "transformers":
        from transformers import HfArgumentParser, TrainingArguments

        (args,) = HfArgumentParser(TrainingArguments).parse_json_file(str(file))
        assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16
        assert args.gradient_checkpointing
        assert args.per_device_train_batch_size <= micro
    else:
        from deepspeed.runtime.config import DeepSpeedConfig

        parsed = DeepSpeedConfig(json.loads(file.read_text()))
        assert parsed.train_batch_size == 16
        assert parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps == 16


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers must be an integer >= 1, got '2'"),
        ({"model_type": None}, "has no model_type"),
        ({"max_position_embeddings": 64}, "--seq-len 128 is longer than the model's 64"),
    ],
)
def test_a_bad_config_is_refused_in_one_line_before_any_trace(tmp_path, config, needle):
    model = llama(tmp_path / "model", **config)
    done = in_process("plan", "--device", "cuda", "--hf-model", model, "--seq-len", 128)
    one_line(done, needle)
    assert not (tmp_path / "cache").exists()  # refused before any trace (each is cached)


def test_an_oversized_or_unreadable_config_is_refused_unread(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    with open(folder / "config.json", "wb") as f:
        f.truncate(8 << 20)  # 8 MiB of nothing (sparse): never read whole
    one_line(in_process("plan", "--device", "cuda", "--hf-model", folder), "8388608 bytes")
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # a FIFO: a blocking read would wait forever
    one_line(in_process("plan", "--device", "cuda", "--hf-model", folder), "FIFO")


def test_a_trace_past_its_limit_stops_in_one_line_naming_where(tmp_path):
    model = llama(tmp_path / "model", num_hidden_layers=400, hidden_size=256)
    done = in_process("plan", "--device", "cuda", "--hf-model", model, "--micro-batch", 1,
                      "--trace-limit", 4)  # fmt: skip
    assert done.returncode == 2
    error = done.stderr.strip().splitlines()[-1]
    assert "did not finish within --trace-limit 4 s" in error, error
    assert "Traceback" not in done.stderr


def test_the_trace_process_ends_with_its_parent_and_leaves_no_folder(tmp_path):
    model = llama(tmp_path / "model", num_hidden_layers=400, hidden_size=256)
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen(
        [sys.executable, "-m", "gradaccum", "plan", "--device", "cuda", "--hf-model", model,
         "--micro-batch", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    child = None
    deadline = time.monotonic() + 60
    while child is None and time.monotonic() < deadline:
        time.sleep(0.2)
        child = next(iter(_children(parent.pid)), None)
    assert child is not None, "the trace process never started"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30  # a hang guard: its stdin closes at once
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child), "the trace process outlived its parent"
    assert not list(tmp_path.glob("gradaccum-estimate-*"))


def _children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_damaged_estimate_cache_entries_are_said_and_estimated_over(tmp_path):
    from gradaccum.app import plan_cache

    model = llama(tmp_path / "model")
    args = ("plan", "--device", "cuda", "--hf-model", model, "--seq-len", 32, "--micro-batch", 2,
            "--json")  # fmt: skip
    first = in_process(*args)
    assert first.returncode == 0, first.stderr
    traced = json.loads(first.stdout)
    (entry,) = [
        p for p in (tmp_path / "cache").glob("*.json") if '"estimate traces"' not in p.read_text()
    ]
    stored = json.loads(entry.read_text())
    stored["plan"]["total"] = "lots"  # checksum made again: whole, but not an estimate
    body = {"key": stored["key"], "plan": stored["plan"]}
    damaged = {
        "not an estimate": json.dumps({**body, "sha256": plan_cache.checksum(body)}),
        "a FIFO": None,
        "a directory": None,
        "too large": None,
    }
    for what, text in damaged.items():
        if entry.is_dir():
            entry.rmdir()
        else:
            entry.unlink()
        if what == "a FIFO":
            os.mkfifo(entry)
        elif what == "a directory":
            entry.mkdir()
        elif what == "too large":
            with open(entry, "wb") as f:
                f.truncate(1 << 30)  # sparse: a whole read would take a gigabyte
        else:
            entry.write_text(text)
        again = in_process(*args)
        assert again.returncode == 0, (what, again.stderr)
        assert json.loads(again.stdout)["total"] == traced["total"], what
        assert f"the cached estimate {entry}" in again.stderr, (what, again.stderr)


@pytest.mark.slow  # a search over lengths, each traced (about a minute): the slow tier
def test_the_longest_sequence_that_fits_is_one_command(tmp_path):
    model = llama(tmp_path / "model", max_position_embeddings=512)
    fixed = ("--hf-model", model, "--micro-batch", 1, "--effective-batch", 4)
    short, long = (estimate(*fixed, "--seq-len", n)["total"] for n in (128, 512))
    budget = (short + long) // 2
    found = estimate(*fixed, "--longest", "--budget", f"{budget}B")
    length = found["longest"]
    assert 128 <= length < 512 and length % 8 == 0
    # the length said fits, the next one the search could say does not
    assert estimate(*fixed, "--seq-len", length, "--budget", f"{budget}B")["total"] <= budget
    assert estimate(*fixed, "--seq-len", length + 8, "--budget", f"{budget}B")["total"] > budget


@pytest.mark.slow  # a measured plan with its fresh process: about 30 s
def test_plan_hf_model_without_the_estimate_measures_on_this_machine(tmp_path):
    pytest.importorskip("peft")
    model = llama(tmp_path / "model")
    done = in_process("plan", "--hf-model", model, "--lora", 2, "--effective-batch", 8,
                      "--budget", "2GB", "--prefer", "largest", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)
    assert "estimate" not in planned and planned["effective_batch"] == 8
    assert planned["probes"] and planned["micro_size"] >= 1


@pytest.mark.slow  # three estimates, searches among them (half a minute): the slow tier
def test_the_largest_micro_batch_is_decided_by_whole_model_traces(tmp_path):
    """The 2- and 3-block line only guesses: the size said fits and the next does not, each
    as the whole model traces it at that size."""
    model = llama(tmp_path / "model")
    fixed = ("--hf-model", model, "--seq-len", 64, "--effective-batch", 16)
    totals = {m: estimate(*fixed, "--micro-batch", m)["total"] for m in (3, 4)}
    for budget in (totals[3], totals[4] - 1):
        found = estimate(*fixed, "--budget", f"{budget}B")
        assert found["largest"] == 3, (budget, found["largest"], totals)


def test_eager_attention_keeps_the_attention_matrix_in_the_estimate(tmp_path):
    """A run with eager attention (every Hugging Face model before SDPA, many custom ones
    still) keeps each layer's seq x seq attention probabilities for backward; the estimate
    took the SDPA path always and said nothing."""
    model = llama(tmp_path / "model", max_position_embeddings=1024)
    fixed = ("--hf-model", model, "--seq-len", 1024, "--micro-batch", 2, "--precision", "bf16")
    sdpa = estimate(*fixed, "--attn-implementation", "sdpa")
    eager = estimate(*fixed, "--attn-implementation", "eager")
    default = estimate(*fixed)
    # 6 layers x 2 sequences x 4 heads x 1024^2 probabilities, in fp32 and bf16 at least
    matrices = 6 * 2 * 4 * 1024 * 1024 * 2
    assert eager["parts"]["activations"] - sdpa["parts"]["activations"] >= matrices
    assert default["total"] == sdpa["total"]
    assert "attention: sdpa, what transformers picks" in " ".join(default["assumptions"])
    assert "attention: eager (--attn-implementation)" in " ".join(eager["assumptions"])


@pytest.mark.slow  # seven estimates, two of them searches: the slow tier
def test_a_neighbouring_question_is_read_off_the_traces_without_a_trace(tmp_path, monkeypatch):
    """Another budget or micro-batch after a question: read off the whole model's traces at
    2 and 3 (no trace process: a limit no trace could meet is never reached), and what a
    fresh trace at that size alone gives."""
    model = llama(tmp_path / "model")
    fixed = ("--hf-model", model, "--seq-len", 64, "--effective-batch", 16, "--precision", "bf16",
             "--checkpointing", "on")  # fmt: skip

    def fresh(micro: int) -> dict:  # that size traced alone, in an empty cache
        monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / f"fresh{micro}"))
        try:
            return estimate(*fixed, "--micro-batch", micro)
        finally:
            monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "cache"))

    traced = {m: fresh(m) for m in (5, 6)}
    first = estimate(*fixed, "--budget", f"{traced[5]['total']}B")
    assert first["largest"] == 5 and first["total"] == traced[5]["total"], first
    assert any("read off the whole model's traces at 2 and 3" in a for a in first["assumptions"])
    for extra in (("--micro-batch", 6), ("--budget", f"{traced[6]['total']}B")):
        read = estimate(*fixed, *extra, "--trace-limit", "0.01")
        micro = read["micro_batch"]
        assert micro >= 6, (extra, micro)
        want = traced.get(micro) or fresh(micro)
        for field in ("allocated", "reserved", "total", "parts"):
            assert read[field] == want[field], (extra, micro, field)


@pytest.mark.slow  # six estimates: the slow tier
def test_a_sequence_length_neighbour_is_read_off_the_traces_at_another(tmp_path, monkeypatch):
    """Another --seq-len after a question: the whole model read off its traces at the first
    length and its 2-block model's at both (said in the assumptions), and what a fresh
    estimate at that length alone gives, size for size."""
    model = llama(tmp_path / "model")
    fixed = ("--hf-model", model, "--effective-batch", 16, "--precision", "bf16",
             "--checkpointing", "on")  # fmt: skip
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "budget"))
    budget = estimate(*fixed, "--seq-len", 64, "--micro-batch", 6)["total"]
    fixed += ("--budget", f"{budget}B")  # 6 fits at 64 tokens: more will at 40
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "cache"))
    first = estimate(*fixed, "--seq-len", 64)
    assert not any("read off those at" in a for a in first["assumptions"])
    read = estimate(*fixed, "--seq-len", 40)
    assert any("40 tokens read off those at 64" in a for a in read["assumptions"]), read
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "fresh"))
    fresh = estimate(*fixed, "--seq-len", 40)
    assert read["micro_batch"] == fresh["micro_batch"] > first["micro_batch"] >= 2
    for field in ("allocated", "reserved", "total", "parts"):
        assert read[field] == fresh[field], field
    # a size the search did not decide: one more, read off the read ones at 2 and 3
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "cache"))
    again = estimate(*fixed, "--seq-len", 40, "--micro-batch", 5)
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "fresh5"))
    want = estimate(*fixed, "--seq-len", 40, "--micro-batch", 5)
    assert again["total"] == want["total"] and again["parts"] == want["parts"]


@pytest.mark.slow  # three estimates: the slow tier
def test_a_refused_lengths_half_is_offered_as_the_earlier_answer(tmp_path, monkeypatch):
    """Refused at twice an earlier question's length: its "--seq-len" alternative is that
    question's whole-model trace at micro-batch 1, the same bytes, not the 2- and 3-block
    line (which said 19.8 GiB where the question at that length had answered 20.0 GiB)."""
    model = llama(tmp_path / "model", hidden_size=256, intermediate_size=512, vocab_size=4096)
    fixed = ("--hf-model", model, "--effective-batch", 8, "--precision", "bf16", "--lora", 4,
             "--checkpointing", "on")  # fmt: skip
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "alone"))
    long = estimate(*fixed, "--seq-len", 256, "--micro-batch", 1)["total"]
    monkeypatch.setenv("GRADACCUM_PLAN_CACHE", str(tmp_path / "cache"))
    short = estimate(*fixed, "--seq-len", 128, "--micro-batch", 1)["total"]
    assert short < long
    done = in_process("plan", "--device", "cuda", *map(str, fixed), "--seq-len", "256",
                      "--budget", f"{(short + long) // 2}B", "--json")  # fmt: skip
    assert done.returncode == 2, done.stderr
    offered = {a["flag"]: a for a in json.loads(done.stdout)["alternatives"]}
    assert offered["--seq-len 128"] == {"flag": "--seq-len 128", "total": short, "traced": True}
    assert "--seq-len 128" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # a 400-layer model's build and traces: the slow tier
def test_the_side_by_side_traces_end_with_their_parent(tmp_path):
    """The whole model's traces at 1, 2 and 3 run side by side, each in a process forked from
    the trace process: a SIGKILL of the command ends them all."""
    model = llama(tmp_path / "model", num_hidden_layers=400, hidden_size=256)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen(
        [sys.executable, "-m", "gradaccum", "plan", "--device", "cuda", "--hf-model", model,
         "--effective-batch", "16", "--seq-len", "32"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    forked: list[int] = []
    deadline = time.monotonic() + 120  # a hang guard: the 2-block trace comes first
    while len(forked) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.2)
        forked = [g for c in _children(parent.pid) for g in _children(c)]
    assert len(forked) >= 2, "the traces never ran side by side"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30  # a hang guard: they end with the trace process
    while any(map(_alive, forked)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, forked)), "a side-by-side trace outlived the command"


@pytest.mark.slow  # six estimates: the slow tier keeps make test under 8 minutes
def test_a_config_s_quantization_config_is_the_estimate_s_base(tmp_path):
    """A model saved quantized carries its quantization_config in config.json, and
    from_pretrained quantizes by it: the estimate took the base unquantized and said
    nothing. bitsandbytes' is now the estimate's base (what --quantize gives, said as
    coming from the config); another method is refused in one line; so are a --quantize
    that disagrees and a quantized base without adapters."""
    pytest.importorskip("peft")
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True,
           "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}  # fmt: skip
    quantized = llama(tmp_path / "quantized", quantization_config=bnb)
    plain = llama(tmp_path / "plain")
    common = ("--seq-len", 32, "--micro-batch", 2, "--lora", 8, "--precision", "bf16")
    from_config = estimate("--hf-model", quantized, *common)
    flagged = estimate("--hf-model", plain, *common, "--quantize", "nf4", "--double-quant")
    unquantized = estimate("--hf-model", plain, *common)
    assert from_config["total"] == flagged["total"] and from_config["parts"] == flagged["parts"]
    assert from_config["parts"]["parameters"] < unquantized["parts"]["parameters"]
    assert (
        "bitsandbytes nf4 with double quantization, as --hf-model's config.json's"
        in (from_config["assumptions"][0])
    )
    refusals = {
        "disagrees with --hf-model's quantization_config": (quantized, *common, "--quantize",
                                                            "8bit"),
        "trains adapters only: add --lora R": (quantized, "--seq-len", 32, "--micro-batch", 2),
    }  # fmt: skip
    # GPTQ 4-bit is the estimate's base too (auto-gptq's packed layer, the config's group
    # size), as --quantize gptq gives it; GPTQ 8-bit and AWQ are refused
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    packed = estimate("--hf-model", llama(tmp_path / "gptq", quantization_config=gptq), *common)
    assert "GPTQ 4-bit, group size 32, as --hf-model's config.json's" in packed["assumptions"][0]
    assert packed["parts"]["parameters"] < unquantized["parts"]["parameters"]
    gptq8 = {**gptq, "bits": 8}
    refusals["its quantization_config is gptq (8-bit, group size 32)"] = (
        llama(tmp_path / "gptq8", quantization_config=gptq8),
        *common,
    )
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    refusals["its quantization_config is awq (4-bit, group size 128)"] = (
        llama(tmp_path / "awq", quantization_config=awq),
        *common,
    )
    for needle, args in refusals.items():
        done = in_process("plan", "--device", "cuda", "--hf-model", *map(str, args))
        one_line(done, needle)
