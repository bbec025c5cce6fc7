"""The CUDA checks, in one script for the first machine with a GPU: at most 10 minutes on one.

1. Exactness in bf16 and fp16: a window of 8 micro-batches against the full batch in float64
   (on the CPU), beside the same full batch under the same autocast (the rounding floor).
2. A real out-of-memory error: ``torch.cuda.set_per_process_memory_fraction`` caps the
   allocator between the peak of half the micro-batch and the peak of the whole one; the
   window with ``OOMReplay`` runs out, is replayed at half size, and its step is compared
   with the float64 full batch.
3. Seconds per optimizer step against N, the micro-batches of one effective batch.
5. The estimate against the real run (``ga.estimate``, fake tensors, against the same window
   on this GPU): allocated, reserved and the device total (nvidia-smi's used memory, from
   ``torch.cuda.mem_get_info``) for the MLP, the gpt recipe and a tiny Llama (full, LoRA, bf16).
4. The plan against the whole run's real peak: ``gradaccum train`` on gpt, segment, minilm
   and a LoRA tiny GPT-2 on text of varying line lengths, each at two budgets, 20 steps with
   held-out evaluations and checkpoints; the plan's measured peak beside the run's
   ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()``, and the budget.

On a machine without CUDA it says so and exits 0. Checks 1 and 3 run on any device (the
tests run them on the CPU: tests/integration/test_bench_gpu.py); check 2 needs CUDA's memory
fraction, and check 4's peaks are CUDA's allocator statistics (on the CPU the flow runs,
without them). Writes bench/results/gpu.md and gpu.json.
"""

from __future__ import annotations

import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import gradaccum as ga

OUT = Path(__file__).parent / "results"
DEADLINE_S = 480  # no new case of check 4 starts after this: the script ends within 10 min


def model(width: int = 256, depth: int = 4) -> torch.nn.Module:
    """An MLP classifier whose activations grow with the batch (GELU keeps its input)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, width), torch.nn.GELU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def loss_fn(net: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, int]:
    x, y = micro
    return ga.sample_mean(F.cross_entropy(net(x).float(), y, reduction="none"))


def reference_gradient(net: torch.nn.Module, data: Any) -> list[torch.Tensor]:
    """The full batch's mean gradient in float64 on the CPU: torch alone."""
    ref = copy.deepcopy(net).cpu().double()
    x, y = data
    F.cross_entropy(ref(x.double()), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


def window_gradient(
    net: torch.nn.Module, data: Any, micro: int, device: torch.device, precision: str, **kw
) -> tuple[list[torch.Tensor], ga.StepResult]:
    """The gradient the optimizer is handed at the window's end (unscaled, normalized),
    read by a hook on its step."""
    net = copy.deepcopy(net).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    seen: list[torch.Tensor] = []

    def read(opt, args, kwargs) -> None:
        seen[:] = [p.grad.double().cpu() for p in net.parameters()]

    optimizer.register_step_pre_hook(read)
    acc = ga.Accumulator(net, optimizer, precision=precision, **kw)
    result = acc.step(ga.split(ga.batching.to_device(data, device), micro), loss_fn)
    return seen, result


def full_batch_gradient(
    net: torch.nn.Module, data: Any, device: torch.device, precision: str
) -> list[torch.Tensor]:
    """The same full batch under the same autocast without accumulation: the rounding floor."""
    net = copy.deepcopy(net).to(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    x, y = ga.batching.to_device(data, device)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        out = net(x)
    F.cross_entropy(out.float(), y).backward()
    return [p.grad.double().cpu() for p in net.parameters()]


def relative_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = sum(float((g - r).norm() ** 2) for g, r in zip(got, ref, strict=True)) ** 0.5
    return num / sum(float(r.norm() ** 2) for r in ref) ** 0.5


def exactness(device: torch.device, n: int = 256, micro: int = 32) -> list[dict[str, Any]]:
    net, data = model(), batch(n)
    ref = reference_gradient(net, data)
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        got, _ = window_gradient(net, data, micro, device, precision)
        floor = relative_error(full_batch_gradient(net, data, device, precision), ref)
        rows.append(
            {
                "precision": precision,
                "micro_batches": n // micro,
                "window_error": relative_error(got, ref),
                "full_batch_error": floor,
            }
        )
    return rows


def seconds_per_step(device: torch.device, n: int = 512, repeats: int = 5) -> list[dict]:
    net, data = model(width=1024), batch(n)
    net = net.to(device)
    moved = ga.batching.to_device(data, device)
    acc = ga.Accumulator(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    rows = []
    for count in (1, 2, 4, 8, 16):
        micro = n // count
        acc.step(ga.split(moved, micro), loss_fn)  # warm-up: kernels, allocator
        times = []
        for _ in range(repeats):
            _sync(device)
            began = time.perf_counter()
            acc.step(ga.split(moved, micro), loss_fn)
            _sync(device)
            times.append(time.perf_counter() - began)
        rows.append(
            {"micro_batches": count, "micro_size": micro, "seconds": statistics.median(times)}
        )
    return rows


def real_oom(device: torch.device, n: int = 4096, micro: int = 1024) -> dict[str, Any]:
    """CUDA only: a window that runs out of memory for real, replayed at half size."""
    net, data = model(width=4096), batch(n)

    def peak_of(size: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        window_gradient(net, data, size, device, "fp32")
        return torch.cuda.max_memory_reserved(device)

    whole, half = peak_of(micro), peak_of(micro // 2)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = (whole + half) / 2
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        got, result = window_gradient(net, data, micro, device, "fp32", oom=ga.OOMReplay())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    return {
        "peak_whole": whole,
        "peak_half": half,
        "cap": cap,
        "oom_replays": result.oom_replays,
        "error": relative_error(got, reference_gradient(net, data)),
    }


def cases(tmp: Path) -> list[tuple[str, dict[str, Any]]]:
    lora = _tiny_gpt2(tmp)
    out = []
    for budget in ("512MB", "256MB"):
        out.append((f"gpt, {budget}", {"recipe": "gpt", "budget": budget}))
    for budget in ("320MB", "200MB"):
        out.append((f"segment, {budget}", {"recipe": "segment", "budget": budget}))
    for budget in (None, "600MB"):
        options = {"recipe": "minilm", **({"budget": budget} if budget else {})}
        out.append((f"minilm, {budget or 'default'}", options))
    for budget in ("200MB", "100MB"):
        out.append((f"LoRA tiny GPT-2, {budget}", {**lora, "budget": budget}))
    return out


def plans_vs_runs(device: torch.device, tmp: Path, began: float, only=None) -> list[dict]:
    """Each case trained for 20 steps (evaluations and checkpoints every 10): the plan's
    measured peak, the run's allocator peaks (CUDA) and the budget."""
    from gradaccum.app import TrainConfig, train
    from gradaccum.memory import parse_bytes

    rows = []
    for name, options in only or cases(tmp):
        if time.perf_counter() - began > DEADLINE_S:
            rows.append({"case": name, "skipped": "the script's 10 minutes"})
            continue
        out = tmp / f"run-{len(rows)}"
        cfg = TrainConfig.of(
            **options, steps=20, eval_every=10, checkpoint_every=10, out=str(out), tensorboard=False
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            summary = train(cfg, log=lambda *a, **k: None)
        except Exception as err:  # a case that cannot run here is a row, not the end
            rows.append({"case": name, "failed": f"{type(err).__name__}: {err}"})
            continue
        plan = json.loads((out / "plan.json").read_text())
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        row = {
            "case": name,
            "budget": parse_bytes(cfg.memory.budget),
            "usable": parse_bytes(cfg.memory.budget) * (1 - cfg.memory.margin),
            "plan": f"{plan['micro_batches']} x {plan['micro_size']}",
            # the whole run's prediction: the window, or a phase (evaluation, a checkpoint,
            # the exports) above it
            "predicted": max(
                [plan.get("predicted_peak", 0), *(p["peak_bytes"] for p in plan.get("phases", ()))]
            ),
            "training_peak": max(x["peak_memory"] for x in metrics),
            "phases": json.loads((out / "memory.json").read_text())["phases"]
            if (out / "memory.json").is_file()
            else None,
            "steps": summary["steps"],
        }
        if device.type == "cuda":
            row["allocated"] = torch.cuda.max_memory_allocated(device)
            row["reserved"] = torch.cuda.max_memory_reserved(device)
        rows.append(row)
    return rows


def estimate_vs_real(device: torch.device) -> list[dict[str, Any]]:
    """``ga.estimate`` for this GPU beside the real window: two windows of two micro-batches,
    AdamW, on a freshly emptied allocator; the device total is nvidia-smi's used memory after
    the run (the allocator keeps its peak segments cached, so it is context + reserved)."""
    from gradaccum.app.recipes import get_recipe

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4)

    def mlp_sample(n: int):
        return batch(n)

    cases: list[tuple[str, Any, Any, Any, dict[str, Any]]] = [
        ("mlp", model, mlp_sample, loss_fn, {}),
    ]
    gpt = get_recipe("gpt")
    cases.append(("gpt recipe", gpt.build_model, gpt.sample_batch, gpt.loss_fn, {}))
    try:
        import transformers

        config = transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
            vocab_size=32000, max_position_embeddings=1024,
        )  # fmt: skip

        def llama():
            return transformers.AutoModelForCausalLM.from_config(config)

        def lm_sample(n: int):
            ids = torch.randint(0, 32000, (n, 512))
            return {"input_ids": ids, "labels": ids}

        def lm_loss(net, b):
            return ga.causal_lm_loss(net(input_ids=b["input_ids"]).logits, b["labels"])

        cases.append(("llama 4x512, full", llama, lm_sample, lm_loss, {}))
        cases.append(("llama 4x512, bf16", llama, lm_sample, lm_loss, {"precision": "bf16"}))
        try:
            from gradaccum.integrations.peft import apply_lora

            lora = {"prepare": lambda m: apply_lora(m, r=8)}
            cases.append(("llama 4x512, LoRA r=8", llama, lm_sample, lm_loss, lora))
        except ImportError:
            pass
    except ImportError:
        pass
    rows = []
    for name, build, sample, loss, how in cases:
        est = ga.estimate(build, adamw, sample, loss, micro_size=4, micro_batches=2, **how)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(0)
        net = build()
        if how.get("prepare"):
            net = how["prepare"](net)
        net = net.to(device)
        acc = ga.Accumulator(net, adamw([p for p in net.parameters() if p.requires_grad]),
                             precision=how.get("precision", "fp32"))  # fmt: skip

        def to_device(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x

        for _ in range(2):
            micro = [torch.utils._pytree.tree_map(to_device, sample(4)) for _ in range(2)]
            acc.step(micro, loss)
        _sync(device)
        free, total = torch.cuda.mem_get_info(device)
        real = {
            "allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.max_memory_reserved(device),
            "total": total - free,
        }
        rows.append({"case": name, "predicted": est.to_dict(), "measured": real})
        del net, acc
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False); nothing "
            "to measure: run it on a machine with a GPU"
        )
        return 0
    began = time.perf_counter()
    device = torch.device("cuda")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    checks = (
        ("exactness", exactness),
        ("oom", real_oom),
        ("per_step", seconds_per_step),
        ("estimate", estimate_vs_real),
    )
    for key, check in checks:
        try:
            results[key] = check(device)
        except Exception as err:  # one failed check is a result; the others still run
            results[key] = {"failed": f"{type(err).__name__}: {err}"}
        print(f"{key}: {results[key]}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results["plans"] = plans_vs_runs(device, Path(tmp), began)
    results["seconds"] = time.perf_counter() - began
    OUT.mkdir(exist_ok=True)
    (OUT / "gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    (OUT / "gpu.md").write_text(report(results))
    print(report(results))
    return 0


def report(r: dict[str, Any]) -> str:
    def mib(b: Any) -> str:
        return f"{b / 2**20:.1f} MiB" if isinstance(b, (int, float)) else "-"

    def section(title: str, key: str, table: Any) -> list[str]:
        value = r.get(key)
        if isinstance(value, dict) and "failed" in value:
            return [f"## {title}", "", f"failed: {value['failed']}", ""]
        return [f"## {title}", "", *table(value), ""]

    def exact(rows: list[dict]) -> list[str]:
        return [
            "| precision | micro-batches | window | full batch, same precision |",
            "|---|---:|---:|---:|",
            *[
                f"| {x['precision']} | {x['micro_batches']} | {x['window_error']:.2e} | "
                f"{x['full_batch_error']:.2e} |"
                for x in rows
            ],
        ]

    def oom(x: dict) -> list[str]:
        return [
            f"Allocator capped at {mib(x['cap'])} (reserved at the whole micro-batch "
            f"{mib(x['peak_whole'])}, at half {mib(x['peak_half'])}): {x['oom_replays']} "
            f"replay(s); the step's gradient against float64: {x['error']:.2e}."
        ]

    def per_step(rows: list[dict]) -> list[str]:
        return [
            "| N | micro-batch | seconds per step |",
            "|---:|---:|---:|",
            *[f"| {x['micro_batches']} | {x['micro_size']} | {x['seconds']:.4f} |" for x in rows],
        ]

    def plans(rows: list[dict]) -> list[str]:
        out = [
            "| case | plan | planned peak | training peak | allocated | reserved | budget |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for x in rows:
            if "plan" not in x:
                out.append(f"| {x['case']} | {x.get('skipped') or x.get('failed')} | | | | | |")
                continue
            out.append(
                f"| {x['case']} | {x['plan']} | {mib(x['predicted'])} | "
                f"{mib(x['training_peak'])} | {mib(x.get('allocated'))} | "
                f"{mib(x.get('reserved'))} | {mib(x['budget'])} |"
            )
        return out

    def estimates(rows: list[dict] | None) -> list[str]:
        if rows is None:
            return ["not run"]
        out = [
            "| case | allocated: estimate | real | reserved: estimate | real | "
            "total: estimate | real |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for x in rows:
            p, m = x["predicted"], x["measured"]
            cells = [
                f"{mib(p[k])} | {mib(m[k])} ({(p[k] - m[k]) / m[k]:+.1%})"
                for k in ("allocated", "reserved", "total")
            ]
            out.append(f"| {x['case']} | " + " | ".join(cells) + " |")
        return out

    return "\n".join(
        [
            "# CUDA checks",
            "",
            f"`python bench/gpu.py` on {r['device']} (torch {r['torch']}), "
            f"{r.get('seconds', 0):.0f} s.",
            "",
            *section(
                "Exactness (the gradient's relative error against float64)", "exactness", exact
            ),
            *section("A real out-of-memory error", "oom", oom),
            *section("Seconds per step against N", "per_step", per_step),
            *section("The plan against the whole run's peak (20 steps)", "plans", plans),
            *section("The estimate (fake tensors) against the real window", "estimate", estimates),
        ]
    )


def _tiny_gpt2(tmp: Path) -> dict[str, Any]:
    """A GPT-2 of 2 layers saved with its weights, and text whose lines vary in length."""
    import transformers

    folder = tmp / "tiny-gpt2"
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=128, n_positions=256, vocab_size=256
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    text = tmp / "lines.txt"
    words = Path(json.__file__).read_text().split()
    text.write_text("\n".join(" ".join(words[i : i + 1 + i % 97]) for i in range(0, 6000, 7)))
    return {"hf_model": str(folder), "data": str(text), "lora": 8}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
