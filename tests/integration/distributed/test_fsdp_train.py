"""`torchrun --nproc-per-node 2 -m gradaccum train --shard fsdp`: FSDP2 from the command line
(2 gloo processes on 127.0.0.1), against the same run in one process, and resumed after
SIGTERM from its sharded checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import helpers
import pytest
import torch
from helpers import max_rel_err
from launch import free_port, torchrun

from gradaccum.app.recipes import get_recipe

# The default recipe (the byte-level GPT, 4 blocks), small windows: 8 sequences a step, 2
# micro-batches of 2 on each rank; evaluation and checkpoints along the way.
ARGS = [
    "train",
    "--recipe",
    "gpt",
    "--steps",
    "10",
    "--effective-batch",
    "8",
    "--micro-batch",
    "2",
    "--eval-every",
    "5",
    "--checkpoint-every",
    "4",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    return helpers.run(cmd, cwd, timeout=60)


metrics = helpers.run_lines


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    proc = run([*torchrun(), "-m", "gradaccum", *ARGS, "--shard", "fsdp", "--out", "two"], root)
    return root, proc


def test_fsdp_trains_as_one_process_and_leaves_the_whole_model(fsdp_run):
    root, proc = fsdp_run
    assert "FSDP2 over 2 processes: 4 blocks and the root" in proc.stdout
    run([sys.executable, "-m", "gradaccum", *ARGS, "--out", "one"], root)
    two, one = root / "two", root / "one"

    lines, single = metrics(two), metrics(one)
    assert [x["step"] for x in lines] == list(range(1, 11))
    for a, b in zip(lines, single, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (
            a["step"],
            a["loss"],
            b["loss"],
        )
        if "eval_loss" in b:
            assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * b["eval_loss"]

    # model.pt: the shards gathered into plain tensors under the model's own names, which
    # load into the unwrapped model; within fp32 rounding of the one-process run's weights.
    whole = torch.load(two / "model.pt", weights_only=True)
    model = get_recipe("gpt").build_model()
    model.load_state_dict(whole)  # strict: every name and shape
    want = torch.load(one / "checkpoint.pt", weights_only=True)["accumulator"]["model"]
    assert max_rel_err(dict(model.state_dict()), want) <= 1e-5
    start = get_recipe("gpt").build_model().state_dict()
    assert max_rel_err(dict(model.state_dict()), start) > 1e-3  # training moved them

    # The checkpoint names its shards; the shard folders of older steps are gone.
    saved = torch.load(two / "checkpoint.pt", weights_only=True)
    assert saved["accumulator"]["shards"] == "shards/step-00000010"
    kept = sorted(p.name for p in (two / "shards").iterdir())
    assert kept == ["step-00000008", "step-00000010"]  # --keep-checkpoints 2
    files = {p.name for p in (two / "shards" / "step-00000010").iterdir()}
    assert {"rank-0.pt", "rank-1.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} == files
    # with the SHA-256 of each, which a resume checks before any rank reads them
    digests = saved["accumulator"]["files"]
    assert set(digests) == files and all(len(d) == 64 for d in digests.values())


@pytest.mark.slow
def test_sigterm_then_resume_from_the_shards_ends_bitwise_equal(fsdp_run):
    root, _ = fsdp_run
    proc = subprocess.Popen(
        [*torchrun(), "-m", "gradaccum", *ARGS, "--shard", "fsdp", "--out", "stopped"],
        cwd=root,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stopped = root / "stopped"
    deadline = time.time() + 45
    while time.time() < deadline and not (
        (stopped / "metrics.jsonl").exists()
        and (stopped / "metrics.jsonl").read_text().count("\n") >= 2
    ):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which passes it to both ranks
    _, err = proc.communicate(timeout=45)
    assert err.count("stopped by SIGTERM at step") == 1, err[-3000:]
    at = torch.load(stopped / "checkpoint.pt", weights_only=True)["step"]
    assert 2 <= at < 10, at

    run([*torchrun(), "-m", "gradaccum", "train", "--resume", "stopped"], root)
    assert [x["step"] for x in metrics(stopped)] == list(range(1, 11))
    straight, resumed = metrics(root / "two"), metrics(stopped)
    assert [x["loss"] for x in resumed] == [x["loss"] for x in straight]
    a = torch.load(stopped / "model.pt", weights_only=True)
    b = torch.load(root / "two" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_flipped_bit_in_a_shard_falls_back_to_the_kept_step_and_ends_bitwise_equal(fsdp_run):
    """One bit of one rank's .distcp file of step 10 flipped (checkpoint.pt and its kept copy
    both name that folder): the resume says which file, goes back to the kept step 8, trains
    steps 9-10 again and leaves the model the run left before the damage."""
    import shutil

    root, _ = fsdp_run
    damaged = root / "damaged"
    shutil.copytree(root / "two", damaged)
    before = torch.load(damaged / "model.pt", weights_only=True)
    [shard, *_] = sorted((damaged / "shards" / "step-00000010").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    proc = run([*torchrun(), "-m", "gradaccum", "train", "--resume", "damaged"], root)
    assert f"{shard.name} is damaged: its bytes do not match the checksum" in proc.stdout
    assert "step-00000008.pt instead, the newest intact checkpoint (step 8)" in proc.stdout
    assert [x["step"] for x in metrics(damaged)] == list(range(1, 11))
    assert [x["loss"] for x in metrics(damaged)] == [x["loss"] for x in metrics(root / "two")]
    after = torch.load(damaged / "model.pt", weights_only=True)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)


class _Payload:  # what a tampered .metadata could hold: a call made while unpickling
    def __reduce__(self):
        return (print, ("payload ran",))


@pytest.mark.slow
def test_tampered_shard_metadata_of_a_checkpoint_without_checksums_is_one_line(fsdp_run):
    """A checkpoint as gradaccum 0.6 wrote it (no checksums: nothing finds the change before
    DCP reads it) whose every .metadata holds a pickled call: DCP's safe reader refuses it on
    both ranks; that is one line each, no traceback, and the call never runs."""
    import pickle
    import shutil

    from gradaccum.app.checkpoints import DIGEST

    root, _ = fsdp_run
    old = root / "old"
    shutil.copytree(root / "two", old)
    for file in [old / "checkpoint.pt", *(old / "checkpoints").glob("*.pt")]:
        saved = torch.load(file, weights_only=True)
        saved.pop(DIGEST)
        saved["accumulator"].pop("files", None)
        torch.save(saved, file)
    for meta in (old / "shards").glob("step-*/.metadata"):
        meta.write_bytes(pickle.dumps(_Payload()))

    cmd = [*torchrun(), "-m", "gradaccum", "train", "--resume", "old"]
    proc = helpers.run(cmd, root, timeout=60, check=False)
    # torchrun's own report of a failed child carries a traceback of torchrun's frames, and
    # its warnings interleave with the ranks' lines: no frame of gradaccum's may appear.
    assert proc.returncode != 0, proc.stderr[-6000:]
    assert not re.search(r'File ".*[/\\]gradaccum[/\\]', proc.stderr), proc.stderr[-6000:]
    assert "payload ran" not in proc.stdout + proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("gradaccum: error: ")]
    # One line from each rank that got to say it: once one rank exits, torchrun sends the
    # other SIGTERM, which can land before that rank reaches its own (identical) refusal
    # (CI saw one line of two).
    assert 1 <= len(errors) <= 2, proc.stderr[-6000:]
    for line in errors:
        assert ".metadata cannot be read safely" in line and "builtins.print" in line, line


def test_fsdp_in_one_process_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", *ARGS, "--shard", "fsdp", "--out", "run"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gradaccum: error: --shard fsdp shards the model over torchrun's processes and this "
        "job has one: launch it with torchrun --nproc-per-node N (N >= 2)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shard": "zero3"}, "shard must be one of ddp, fsdp, got 'zero3'"),
        ({"pipeline_stages": 2}, "shard fsdp with pipeline_stages: one or the other"),
        ({"precision": "fp16"}, "each rank would see only its own shards' overflow"),
        ({"hf_model": "x", "lora": 8}, "the adapters are a few megabytes, nothing to shard"),
    ],
)
def test_what_fsdp_does_not_do_is_named(options, message):
    from gradaccum.app import TrainConfig

    cfg = TrainConfig.of(**{"shard": "fsdp", **options})
    assert any(message in p for p in cfg.problems()), cfg.problems()


@pytest.mark.slow
def test_two_nodes_on_loopback_train_as_two_processes_on_one_node(fsdp_run):
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on 127.0.0.1: what
    `torchrun --nnodes 2` does across machines."""
    root, _ = fsdp_run
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "two-nodes",
                "--local-addr",
                "127.0.0.1",
                "-m",
                "gradaccum",
                *ARGS,
                "--shard",
                "fsdp",
                "--out",
                "nodes",
            ],
            cwd=root,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=60) for agent in agents]
    for agent, (out, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-2000:] + err[-2000:]
    # one run folder, reported once: the agent that got rank 0 speaks for the job
    assert sum("stopped by" in out for out, _ in outputs) == 1
    assert not (root / "nodes" / "nodes").exists()
    one_node = [x["loss"] for x in metrics(root / "two")]
    assert [x["loss"] for x in metrics(root / "nodes")] == one_node


@pytest.mark.slow
def test_fsdp_plans_each_rank_on_its_shards_and_records_the_sync(tmp_path):
    planned = [a for a in ARGS if a not in ("--micro-batch", "2")]
    planned += ["--steps", "2", "--effective-batch", "4"]  # 2 per rank: probes of 1 and 2
    proc = run(
        [*torchrun(), "-m", "gradaccum", *planned, "--shard", "fsdp", "--out", "p"], tmp_path
    )
    assert "each process measuring its shards" in proc.stdout
    assert "gradient sync window: predicted per rank, window" in proc.stdout  # both modes
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["sync"] == "window" and plan["source"] == "planned"
    # what a resume reads back (the resume itself is test_sigterm_then_resume_...'s)
    saved = torch.load(tmp_path / "p" / "checkpoint.pt", weights_only=True)
    assert (saved["sync"], saved["micro_batch"]) == ("window", plan["micro_size"])


@pytest.mark.slow
def test_a_hugging_face_model_under_fsdp_exports_its_own_format(tmp_path):
    """--hf-model under --shard fsdp: each decoder layer its own FSDP2 unit; at the end the
    whole model in Hugging Face's format (save_pretrained), loadable without torchrun."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    start = transformers.GPT2LMHeadModel(config)
    start.save_pretrained(tmp_path / "base")
    args = ["--steps", "2", "--effective-batch", "8", "--micro-batch", "2", "--eval-every", "2"]
    proc = run(
        [*torchrun(), "-m", "gradaccum", "train", "--hf-model", "base", *args, "--shard", "fsdp"]
        + ["--out", "hf"],
        tmp_path,
    )
    assert "FSDP2 over 2 processes: 2 blocks and the root" in proc.stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf" / "export" / "model", local_files_only=True
    )
    whole = torch.load(tmp_path / "hf" / "model.pt", weights_only=True)
    mine = exported.state_dict()
    assert all(torch.equal(mine[k], whole[k]) for k in whole)
    moved = max_rel_err({k: mine[k] for k in whole}, {k: start.state_dict()[k] for k in whole})
    assert moved > 1e-4  # trained, not the starting weights


@pytest.mark.slow
def test_bf16_under_fsdp_computes_as_one_process_does(fsdp_run):
    """--precision bf16 --shard fsdp: autocast runs each forward on the fp32 shards' gathered
    parameters, as in one process, and gradients reduce in fp32. The first loss (the same
    forward on the same parameters) equals one process's bf16 loss bit for bit; after the
    first updates, bf16 amplifies the last-bit differences of the ranks' summation order,
    and the losses stay closer to one process's bf16 run than that is to fp32's. (FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16) would round every parameter, embeddings and norms
    too, before use, which autocast does not: its first loss was 3.6x further from one
    process's bf16 than bf16 is from fp32, so the run keeps autocast.)"""
    root, _ = fsdp_run
    short = [*ARGS, "--steps", "3", "--precision", "bf16"]
    run([*torchrun(), "-m", "gradaccum", *short, "--shard", "fsdp", "--out", "b2"], root)
    run([sys.executable, "-m", "gradaccum", *short, "--out", "b1"], root)
    sharded, single = metrics(root / "b2"), metrics(root / "b1")
    fp32 = metrics(root / "two")[:3]
    assert sharded[0]["loss"] == single[0]["loss"] != fp32[0]["loss"]
    apart = max(abs(a["loss"] - b["loss"]) for a, b in zip(sharded, single, strict=True))
    bf16 = max(abs(b["loss"] - c["loss"]) for b, c in zip(single, fp32, strict=True))
    assert apart < bf16, (apart, bf16)
