"""Every fault ends in a clear message and a run that can continue.

Real subprocesses, real signals (kill -9, SIGHUP, SIGTERM, SIGINT), a real closed pipe, a
real write limit (RLIMIT_FSIZE, as a full disk answers), real damaged files. A message is one
line on stderr and never a traceback; nothing is lost: the checkpoint's step is the last
metrics line's, and no step is recorded twice.
"""

import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import bitwise_equal, run_lines
from helpers import cli as run_cli

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
DIGITS = ["--recipe", "digits", "--effective-batch", "16", "--micro-batch", "8"]


def cli(*args, check=False, **kw):
    return run_cli(*args, check=check, threads=1, **kw)


def _ctrl_c_as_at_a_terminal() -> None:
    # A suite started in the background (`make test &`, nohup) runs with SIGINT ignored, and
    # an ignored signal is inherited: Python then never installs its Ctrl-C handler. The
    # tests send SIGINT as a terminal would, so the child starts with the default action.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gradaccum", *map(str, args)],
        stdout=kw.pop("stdout", subprocess.DEVNULL),
        stderr=kw.pop("stderr", subprocess.PIPE),
        text=True,
        cwd=ROOT,
        env=ENV,
        preexec_fn=kw.pop("preexec_fn", _ctrl_c_as_at_a_terminal),
        **kw,
    )


def wait_for_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        file = run / "metrics.jsonl"
        if file.exists() and file.read_text().count("\n") >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{run}: fewer than {n} steps after {timeout} s")


def kill_after(run: Path, n: int, *args) -> None:
    """Train into ``run`` and SIGKILL the process once ``n`` steps are recorded."""
    proc = start("train", *DIGITS, "--steps", 400, *args, "--out", run)
    wait_for_steps(run, n, proc)
    proc.kill()
    proc.wait()


def steps(run: Path) -> list[int]:
    return [x["step"] for x in run_lines(run)]


def checkpoint_step(run: Path) -> int:
    return torch.load(run / "checkpoint.pt", weights_only=True)["step"]


def in_process(*args) -> subprocess.CompletedProcess:
    """``gradaccum ARGS`` through the CLI's own ``main`` in this process, for input refused
    before anything runs: the same code and exit status as the command, without a second
    interpreter importing torch (a subprocess costs about 2.5 s here)."""
    import contextlib
    import io

    from gradaccum.app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's own refusals
            code = exit_.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line(proc, *needles: str) -> str:
    """The process failed with exit 2 and one line naming what is wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradaccum: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# -- 1, 7: kill -9 at any moment, then --resume ------------------------------------------------


@pytest.mark.slow  # several command runs: the slow tier
def test_a_crash_before_the_first_checkpoint_resumes_from_step_0(tmp_path):
    run = tmp_path / "x"
    # (the incident guard checkpoints step 0 to have something to roll back to: off here)
    kill_after(run, 3, "--checkpoint-every", 1000, "--no-guard")
    assert not (run / "checkpoint.pt").exists()
    done = cli("train", "--resume", run, "--steps", 6, check=True)
    assert "resuming" in done.stdout and "at step 0 of 6" in done.stdout
    assert steps(run) == list(range(1, 7))  # the crashed run's lines were dropped
    assert checkpoint_step(run) == 6


@pytest.mark.slow  # make test keeps its 8 minutes
def test_kill_mid_run_and_a_half_written_line_leave_every_step_once(tmp_path):
    run = tmp_path / "x"
    kill_after(run, 8, "--checkpoint-every", 5)
    saved = checkpoint_step(run)
    assert saved >= 5 and steps(run)[-1] >= saved
    with (run / "metrics.jsonl").open("a") as f:
        if steps(run)[-1] == saved:  # the kill landed just after a checkpoint: add the lines
            for extra in (saved + 1, saved + 2):  # a later kill would have left behind it
                f.write(json.dumps({"step": extra, "loss": 1.0}) + "\n")
        f.write('{"step": 99, "loss": 1.')  # what a crash mid-write leaves
    cli("train", "--resume", run, "--steps", saved + 4, check=True)
    assert steps(run) == list(range(1, saved + 5))
    assert checkpoint_step(run) == saved + 4
    assert json.loads((run / "summary.json").read_text())["steps"] == saved + 4


# -- SIGHUP and a closed pipe stop like SIGTERM: a checkpoint at the window boundary ------------


def test_sighup_checkpoints_at_the_window_boundary(tmp_path):
    run = tmp_path / "x"
    proc = start("train", *DIGITS, "--steps", 400, "--out", run)
    wait_for_steps(run, 3, proc)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert "stopped by SIGHUP at step" in err and "Traceback" not in err
    assert checkpoint_step(run) == steps(run)[-1]


@pytest.mark.slow
def test_under_nohup_sighup_stays_ignored_and_the_run_finishes(tmp_path):
    def as_nohup() -> None:
        _ctrl_c_as_at_a_terminal()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does before exec

    run = tmp_path / "x"
    proc = start("train", *DIGITS, "--steps", 40, "--out", run, preexec_fn=as_nohup)
    wait_for_steps(run, 3, proc)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by" not in err and steps(run) == list(range(1, 41))


def test_a_closed_output_pipe_stops_training_with_a_checkpoint(tmp_path):
    """`gradaccum train ... | head -2`: the reader goes away after two lines."""
    run = tmp_path / "x"
    proc = start(
        "train", *DIGITS, "--steps", 400, "--eval-every", 1000, "--out", run, stdout=subprocess.PIPE
    )
    first = [proc.stdout.readline() for _ in range(2)]
    assert first[0].startswith("training 400 steps")
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGPIPE, err
    assert "output pipe closing" in err and "Traceback" not in err and "BrokenPipe" not in err
    assert checkpoint_step(run) == steps(run)[-1] < 400
    summary = json.loads((run / "summary.json").read_text())  # this session's, not a stale one
    assert summary["stopped_by"] == "signal" and summary["steps"] == steps(run)[-1]


def test_a_closed_pipe_that_also_took_stderr_keeps_the_exit_status(tmp_path):
    """`gradaccum train ... 2>&1 | head -2`: the stop message has nowhere to go; the exit
    status still says why the run stopped (141), not 1 (the guard's)."""
    run = tmp_path / "x"
    proc = start(
        "train", *DIGITS, "--steps", 400, "--eval-every", 1000, "--out", run,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout.readline().startswith("training 400 steps")
    proc.stdout.close()
    proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGPIPE
    assert checkpoint_step(run) == steps(run)[-1] < 400


# -- 8: resume keeps the run's records ------------------------------------------------------


@pytest.mark.slow
def test_resume_keeps_the_plan_and_records_only_what_it_applies(tmp_path):
    run = tmp_path / "x"
    cli(
        "train",
        "--recipe",
        "digits",
        "--effective-batch",
        16,
        "--budget",
        "300MB",
        "--steps",
        4,
        "--out",
        run,
        check=True,
    )
    planned = (run / "plan.json").read_text()
    assert json.loads(planned)["source"] == "planned"
    cli("train", "--resume", run, "--steps", 6, check=True)
    assert (run / "plan.json").read_text() == planned
    assert json.loads((run / "config.json").read_text())["steps"] == 6
    record = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert record == [{"step": 4, "changed": {"steps": [4, 6]}, "after": "its length"}]
    one_line(cli("train", "--resume", run, "--micro-batch", 4), "would change micro_batch")
    one_line(cli("train", "--resume", run, "--steps", 3), "already trained 6 steps")
    assert json.loads((run / "config.json").read_text())["steps"] == 6  # refusals wrote nothing


# -- 10: one line, exit 2, for every unusable input ------------------------------------------


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {Evil.marker}",))


@pytest.mark.slow  # make test keeps its 8 minutes
def test_damaged_checkpoints_are_one_line_and_never_unpickled(tmp_path):
    run = tmp_path / "x"  # (without the guard: no kept checkpoint to fall back to)
    cli("train", *DIGITS, "--steps", 2, "--no-guard", "--out", run, check=True)
    good = (run / "checkpoint.pt").read_bytes()
    Evil.marker = tmp_path / "pwned"
    for damaged in (good[:200], b"", pickle.dumps({"format": Evil()})):
        (run / "checkpoint.pt").write_bytes(damaged)
        line = one_line(cli("train", "--resume", run), "checkpoint.pt cannot be read")
        assert "weights_only=False" not in line
    assert not Evil.marker.exists()


@pytest.mark.parametrize(
    "damage", ["a flipped bit", pytest.param("deleted and truncated", marks=pytest.mark.slow)]
)
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_kept_one(tmp_path, damage):
    """The newest checkpoint (checkpoint.pt and its kept copy, step 30) damaged: the resume
    says so in one line, goes back to the kept step 25, trains steps 26-30 again and ends
    bitwise equal to the run before the damage."""
    from support.faults import flip_tensor_bit

    run = tmp_path / "run"
    args = [*DIGITS, "--steps", 30, "--checkpoint-every", 5, "--eval-every", 10]
    cli("train", *args, "--no-tensorboard", "--out", run, check=True)
    straight = torch.load(run / "checkpoint.pt", weights_only=True)
    losses = [(x["step"], x["loss"], x["count"]) for x in run_lines(run)]
    newest = run / "checkpoints" / "step-00000030.pt"
    if damage == "a flipped bit":
        flip_tensor_bit(run / "checkpoint.pt", record=2, byte=7, bit=5)
        flip_tensor_bit(newest, record=2, byte=7, bit=5)
        said = "checkpoint.pt is damaged: its contents do not match the checksum"
    else:
        (run / "checkpoint.pt").unlink()
        newest.write_bytes(newest.read_bytes()[:1000])
        said = "checkpoint.pt is missing"
    proc = cli("train", "--resume", run, check=True)
    out = proc.stdout + proc.stderr
    assert said in out and "resuming from" in out and "step-00000025.pt instead" in out, out
    assert "(step 25): the steps after it are trained again" in out
    assert "Traceback" not in out
    again = torch.load(run / "checkpoint.pt", weights_only=True)
    assert again["step"] == 30
    for part in ("model", "optimizer"):  # every tensor, every state entry
        assert bitwise_equal(straight["accumulator"][part], again["accumulator"][part]), part
    assert [(x["step"], x["loss"], x["count"]) for x in run_lines(run)] == losses


@pytest.mark.slow  # several command runs: the slow tier
def test_no_intact_checkpoint_is_refused_in_one_line(tmp_path):
    from support.faults import flip_tensor_bit

    run = tmp_path / "run"
    cli("train", *DIGITS, "--steps", 4, "--checkpoint-every", 2, "--out", run, check=True)
    for file in [run / "checkpoint.pt", *sorted((run / "checkpoints").glob("*.pt"))]:
        flip_tensor_bit(file, record=2, byte=3, bit=1)
    line = one_line(cli("train", "--resume", run, "--steps", 6), "checkpoint.pt is damaged")
    assert "no kept checkpoint under checkpoints/ is intact either" in line


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("side") / "run"
    cli("train", *DIGITS, "--steps", 3, "--no-guard", "--out", run, check=True)
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, damage, said",
    [
        ("metrics.jsonl", lambda t: t.replace("\n", "\nnot json\n", 1), "line 2 is damaged"),
        (
            "metrics.jsonl",
            lambda t: t.replace('"step": 2', '"step": "two"', 1),
            "line 2 is damaged",
        ),
        ("metrics.jsonl", bytes(range(256)), "metrics.jsonl (not text)"),
        ("plan.json", "[1, 2]", "plan.json holds a list [1, 2], not a table with micro_size"),
        ("config.json", "[1]", "config.json holds a list [1], not a table with effective_batch"),
        ("config.json", "{", "config.json is not valid JSON"),
    ],
)
def test_damaged_side_files_are_named_in_one_line_at_resume(
    finished_run, tmp_path, name, damage, said
):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    file = run / name
    if callable(damage):
        file.write_text(damage(file.read_text()))
    else:
        file.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    one_line(cli("train", "--resume", run, "--steps", 5), said)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before  # refused before anything was written


def test_argparse_refusals_are_one_line_too():
    one_line(in_process("train", "--steps", "abc"), "argument --steps: invalid int value: 'abc'")
    one_line(in_process("plan", "--bogus"), "unrecognized arguments: --bogus")
    one_line(in_process("frobnicate"), "invalid choice: 'frobnicate'", "--help")


@pytest.mark.slow  # several command runs: the slow tier
def test_unusable_folders_and_files_are_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line(cli("train", *DIGITS, "--out", afile), "is a file, not a folder")  # the command
    one_line(in_process("train", *DIGITS, "--out", "/proc/self/x"), "cannot create run folder")
    one_line(in_process("train", *DIGITS, "--epochs", "inf"), "epochs must be a positive finite")
    one_line(in_process("train", *DIGITS, "--epochs", "nan"), "epochs must be a positive finite")
    one_line(in_process("plan", "--plot", tmp_path / "missing" / "p.png"), "does not exist")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    one_line(in_process("train", "--hf-model", empty), "no config.json in that folder")
    one_line(in_process("check", "--hf-model", afile), "is not a model configuration JSON")
    run = tmp_path / "run"
    cli("train", *DIGITS, "--steps", 1, "--out", run, check=True)
    (run / "config.json").write_text('{"recipe": "dig')
    one_line(in_process("train", "--resume", run), "config.json is not valid JSON")


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow  # several command runs: the slow tier
def test_a_full_disk_stops_with_one_line_and_the_run_resumes(tmp_path):
    """RLIMIT_FSIZE makes every write past 30 kB fail as a full disk does (Python ignores
    SIGXFSZ, so the write returns an error): the first checkpoint, after 5 steps, cannot be
    written. (A start whose first write fails leaves nothing: test_failed_starts.py.)"""
    run = tmp_path / "x"
    full = cli(
        "train",
        *DIGITS,
        "--steps",
        20,
        "--checkpoint-every",
        5,
        "--no-guard",
        "--out",
        run,
        preexec_fn=_limit_file_size(30_000),
    )
    one_line(full, f"cannot write {run / 'checkpoint.pt'}", "continue with")
    cli("train", "--resume", run, "--steps", 8, check=True)
    assert steps(run) == list(range(1, 9)) and checkpoint_step(run) == 8


# -- 11: the smaller ones ----------------------------------------------------------------------


@pytest.mark.slow
def test_config_files_as_people_write_them(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("recipe: digits\neffective-batch: 16\nlr: 2e-3\nbudget: 300000000\nsteps: 1\n")
    cli("train", "--config", yaml, "--out", tmp_path / "a", check=True)
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["lr"] == 0.002 and saved["budget"] == "300000000"
    twice = tmp_path / "t.toml"
    twice.write_text("effective-batch = 16\neffective_batch = 32\n")
    one_line(in_process("train", "--config", twice), "effective-batch and effective_batch")
    one_line(in_process("train", *DIGITS, "--steps", 5, "--epochs", 2), "--steps and --epochs")
    one_line(in_process("train", *DIGITS, "--steps", 5, "--samples", 200), "--steps and --samples")


@pytest.mark.slow  # make test keeps its 8 minutes
def test_a_folder_that_is_not_a_run_or_is_in_use_is_refused(tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("x")
    one_line(cli("train", *DIGITS, "--out", other), "holds files that are not a gradaccum run")
    run = tmp_path / "x"
    first = start("train", *DIGITS, "--steps", 400, "--out", run)
    try:
        wait_for_steps(run, 2, first)
        one_line(cli("train", "--resume", run), "another process is training in")
    finally:
        first.kill()
        first.wait()


# -- 9: signals while planning -------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_planning_children_die_with_their_parent_and_ctrl_c_is_one_line():
    args = ["plan", "--effective-batch", 256, "--budget", "200MB"]

    def measuring_child(proc: subprocess.Popen) -> int:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            child = next(iter(_children(proc.pid)), None)
            if child is not None:
                return child
            time.sleep(0.05)
        raise AssertionError("the plan never started its measuring process")

    proc = start(*args)
    child = measuring_child(proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the measuring process outlived its parent"

    proc = start(*args)
    # Planning, before any training: once its measuring process runs, not after a fixed
    # sleep (a cold start under load was still importing torch after 4 s).
    measuring_child(proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "gradaccum: interrupted" and "Traceback" not in err


# -- 4: a resumed run trains as it was planned ---------------------------------------------


def test_resume_reapplies_the_runs_activation_checkpointing(tmp_path):
    """Checkpointing is part of the plan and of the checkpoint; a resumed run (from either)
    recomputes the same blocks it did before the stop."""
    from gradaccum.app import TrainConfig, build_run
    from gradaccum.recompute import checkpointing_enabled

    run = tmp_path / "x"
    cli(
        "train",
        "--effective-batch",
        8,
        "--micro-batch",
        4,
        "--checkpointing",
        "on",
        "--steps",
        2,
        "--out",
        run,
        check=True,
    )
    assert json.loads((run / "plan.json").read_text())["checkpointing"] is True
    assert torch.load(run / "checkpoint.pt", weights_only=True)["checkpointing"] is True
    saved = json.loads((run / "config.json").read_text())
    for source in ("checkpoint", "plan"):
        if source == "plan":  # as if the run had stopped before its first checkpoint
            (run / "checkpoint.pt").unlink()
        cfg = TrainConfig.of(**{**saved, "resume": str(run), "out": str(run)})
        built = build_run(cfg, log=lambda *a: None)
        try:
            assert built.checkpointing and checkpointing_enabled(built.model), source
        finally:
            built.folder.release()


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"n_layer": "2"}, "n_layer must be an integer >= 1, got '2'"),
        ({"text_config": {"hidden_size": 8}}, "(its nested sections: text_config)"),
        ({"model_type": "no-such-model"}, "transformers cannot make a causal LM of"),
    ],
)
@pytest.mark.parametrize("command", ["train", "check"])
def test_a_config_transformers_cannot_use_is_one_line_naming_the_key(tmp_path, command, config,
                                                                      needle):  # fmt: skip
    """A string where a number goes, or a nested section the model does not take: a 46-53
    line traceback from transformers before (StrictDataclassFieldValidationError,
    AttributeError)."""
    base = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64,
            "n_positions": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    args = ("--steps", 1, "--out", tmp_path / "run") if command == "train" else ()
    one_line(in_process(command, "--hf-model", tmp_path, *args), needle)


def test_a_multimodal_config_is_trained_by_its_language_model(tmp_path):
    """A well-formed gemma3 config (the language model's sizes in its text_config) ended in
    a traceback, AttributeError: 'Gemma3Config' object has no attribute 'vocab_size', in
    train, check and plan."""
    config = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
        "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = in_process("train", "--hf-model", tmp_path, "--steps", 1, "--micro-batch", 2,
                      "--effective-batch", 4, "--out", tmp_path / "run")  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1


@pytest.mark.parametrize("part", ["the run", "its accumulator"])
def test_a_checkpoint_of_a_newer_format_says_which_gradaccum_reads_it(tmp_path, part):
    """It was answered with 'move it away to resume the run from step 0', which throws the
    training away (issue 58); a newer accumulator state inside was 'not a gradaccum
    Accumulator checkpoint', after config.json and resumes.jsonl had been written."""
    import torch

    from gradaccum.app.checkpoints import DIGEST, WRITTEN_BY
    from gradaccum.checkpoint import state_digest

    run = tmp_path / "run"
    done = in_process("train", *DIGITS, "--steps", 1, "--out", run)
    assert done.returncode == 0, done.stderr
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    saved.pop(DIGEST)
    if part == "the run":
        saved.update({"format": "gradaccum.run/2", WRITTEN_BY: "0.9.0"})
        said = ("written by gradaccum 0.9.0", "resume with gradaccum 0.9.0 or newer")
    else:
        saved["accumulator"]["format"] = "gradaccum.accumulator/2"
        said = (f"--resume {run}: its Accumulator state is of format gradaccum.accumulator/2",
                "load it with the gradaccum that wrote it or newer")  # fmt: skip
    torch.save({**saved, DIGEST: state_digest(saved)}, run / "checkpoint.pt")
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    refused = in_process("train", "--resume", run, "--steps", 2)
    one_line(refused, *said)
    assert "move it away" not in refused.stderr
    after = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    assert after == before  # nothing lost, nothing written


def test_a_hand_edited_config_json_is_said_and_recorded_on_resume(tmp_path):
    """It was used with no message and no record (lr 0.5: loss 3.5 -> 15.8; issue 58)."""
    run = tmp_path / "run"
    done = in_process("train", *DIGITS, "--steps", 1, "--out", run)
    assert done.returncode == 0, done.stderr
    config = json.loads((run / "config.json").read_text())
    old_lr = config["lr"]
    (run / "config.json").write_text(json.dumps({**config, "lr": 0.5}))
    resumed = in_process("train", "--resume", run, "--steps", 2)
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stdout + resumed.stderr
    assert (
        f"config.json was edited since the checkpoint of step 1 was written: lr {old_lr!r} -> 0.5"
        in said
    )
    (line,) = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert line["edited"] == {"lr": [old_lr, 0.5]}


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json", "tokenizer.json"])
def test_a_json_file_with_a_byte_order_mark_is_named(tmp_path, file):
    """A tokenizer_config.json saved with a BOM was named nowhere (issue 58), nor was a
    tokenizer.json ('Unexpected UTF-8 BOM (decode using utf-8-sig)')."""
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64,
              "n_positions": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / file).write_bytes(b"\xef\xbb\xbf" + json.dumps(config if file == "config.json"
                                  else {"model_max_length": 64}).encode())  # fmt: skip
    one_line(in_process("check", "--hf-model", tmp_path), f"{file} starts with a byte-order mark")


def test_a_run_folders_config_json_saved_with_a_byte_order_mark_is_said_so(tmp_path):
    """Saved from an editor with a BOM, it was called 'damaged outside gradaccum: restore it,
    or start a new run' (the fix is to save it without the mark)."""
    run = tmp_path / "run"
    done = in_process("train", *DIGITS, "--steps", 1, "--out", run)
    assert done.returncode == 0, done.stderr
    config = run / "config.json"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    refused = one_line(in_process("train", "--resume", run, "--steps", 2),
                       "config.json starts with a byte-order mark", "without a BOM")  # fmt: skip
    assert "damaged" not in refused


def test_a_resume_after_a_stop_without_held_out_numbers_evaluates_at_once(tmp_path):
    """A stop signal abandons the evaluation in progress and the stop evaluates nothing;
    the resume gives the held-out numbers at its first window instead (issue 58)."""
    run = tmp_path / "run"
    args = (*DIGITS, "--eval-every", 100, "--out", run)
    assert in_process("train", *args, "--steps", 2).returncode == 0
    metrics = run / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    lines[-1] = {k: v for k, v in lines[-1].items() if not k.startswith("eval_")}  # as a stop
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert in_process("train", "--resume", run, "--steps", 5).returncode == 0
    evaluated = {x["step"]: any(k.startswith("eval_") for k in x) for x in
                 (json.loads(y) for y in metrics.read_text().splitlines())}  # fmt: skip
    assert evaluated == {1: False, 2: False, 3: True, 4: False, 5: True}
