"""`gradaccum train --data PATH`: your own text, end to end in a subprocess."""

import json
import shutil
import sys

import pytest
from helpers import cli, run, run_lines

FAST = ["--steps", "2", "--micro-batch", "4", "--eval-every", "2", "--seq-len", "16"]


def pairs(path, n, completion="xyz"):
    rows = [{"prompt": f"q{i:02d}:", "completion": completion} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pairs_run(tmp_path_factory):
    """2 steps of the byte GPT on 40 prompt/completion pairs; its data file and run folder."""
    folder = tmp_path_factory.mktemp("pairs")
    data = pairs(folder / "p.jsonl", 40)
    cli("train", "--data", data, "--effective-batch", 8, *FAST, "--out", folder / "run")
    return data, folder / "run"


def test_prompt_completion_trains_on_completion_tokens_only(pairs_run):
    _, out = pairs_run
    steps = run_lines(out)
    # "xyz" and the end-of-text token: 4 tokens that count per pair, 8 pairs per step
    assert [s["count"] for s in steps] == [32, 32]
    assert all("eval_loss" in s for s in steps[-1:])
    assert len(list(out.glob("data-*.pt"))) == 1  # the sequences, for a resume


@pytest.mark.slow  # make test keeps its 8 minutes
def test_resume_reads_the_same_sequences_and_refuses_changed_data(tmp_path, pairs_run):
    data, run = pairs_run
    out = tmp_path / "run"
    shutil.copytree(run, out)  # resumed here, so the module's run stays as it was
    args = ["train", "--data", data, "--effective-batch", 8, *FAST, "--resume", out]
    proc = cli(*args, "--steps", 3)
    assert "resuming" in proc.stdout
    pairs(data, 40, completion="changed")  # (the module's run only reads its folder after)
    proc = cli(*args, "--steps", 4, check=False)
    assert proc.returncode == 2
    assert "is not the data this run began with" in proc.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "the file is empty"),
        (b'{"text": "a"}\n{"text": "\xff"}\n', "data.jsonl:2: not UTF-8 text"),
        (b'{"text": "a"}\n{oops\n', "data.jsonl:2: not JSON"),
        (b'{"body": "a"}\n', "data.jsonl:1: no 'text' field"),
        (b'{"text": "tiny"}\n', "fewer than one effective batch (8)"),
        (b'{"text": "a\x00b"}\n', "data.jsonl:1: a NUL byte: binary data"),
        (b'{"prompt": "' + b"p" * 20 + b'", "completion": "c"}\n', "pair 1: prompt and completion"),
    ],
)
def test_bad_data_is_refused_in_one_line_before_anything_is_written(
    tmp_path, capsys, content, message
):
    """The CLI's own main() in this process (each case as a subprocess costs a torch import;
    the first case also runs as one, for the exit code a shell sees)."""
    from gradaccum.app.cli import main

    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    out = tmp_path / "run"
    args = ["train", "--data", data, "--effective-batch", 8, *FAST, "--out", out]
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    if not content:
        proc = cli(*args, check=False)
        assert proc.returncode == 2 and proc.stderr == err, proc.stderr


def test_data_needs_a_language_model_and_seq_len_needs_data(tmp_path, capsys):
    from gradaccum.app.cli import main

    data = pairs(tmp_path / "p.jsonl", 40)
    args = ["train", "--recipe", "digits", "--data", str(data), "--out", str(tmp_path / "a")]
    assert main(args) == 2
    assert "--data needs a language model" in capsys.readouterr().err
    assert main(["train", "--seq-len", "16", "--out", str(tmp_path / "b")]) == 2
    assert "--seq-len applies to --data only" in capsys.readouterr().err


def test_fine_tuning_options_are_checked_together():
    """All at once, in one message (TrainConfig.problems, what the CLI reports)."""
    from gradaccum.app import TrainConfig

    problems = TrainConfig.of(
        data="x.jsonl", lora=8, merge_lora=True, seq_len=1, eval_fraction=1.0
    ).problems()
    text = "\n".join(problems)
    assert "lora needs --hf-model" in text
    assert "seq_len must be" in text and "eval_fraction must be a number in [0, 1)" in text
    assert TrainConfig.of(merge_lora=True).problems() == ["merge_lora needs --lora R"]
    assert "seq_len applies to --data only" in "\n".join(TrainConfig.of(seq_len=16).problems())


def test_a_sequence_length_the_model_cannot_take_is_refused(tmp_path, capsys):
    from gradaccum.app.cli import main

    data = pairs(tmp_path / "p.jsonl", 40)
    out = tmp_path / "run"
    args = ["train", "--data", data, "--seq-len", 4096, "--out", out]
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert "--seq-len 4096 is longer than the model takes (128 positions)" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


_PEAK = """
import resource, sys
import torch
from pathlib import Path
import gradaccum.app.build  # everything the command has imported before it reads --data
from gradaccum.app.recipes.userdata import DataError, byte_encoder, load_sequences, save_cache

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

before = peak_mib()
try:
    loaded = load_sequences(sys.argv[1], byte_encoder(128), seq_len=128, eval_fraction=0.1, seed=0)
    cache = save_cache(loaded, Path(sys.argv[2])).stat().st_size
except DataError as err:
    cache = str(err)
print(before, peak_mib() - before, cache)
"""


def _peak(tmp_path, data) -> tuple[float, float, str]:
    """(resident MiB once imported, MiB the data added to the peak, cache bytes or error)."""
    proc = run([sys.executable, "-c", _PEAK, data, tmp_path])
    before, added, rest = proc.stdout.split(maxsplit=2)
    return float(before), float(added), rest.strip()


def test_a_2gb_sparse_file_is_refused_without_being_read_whole(tmp_path):
    """A 2 GB file of NUL bytes (sparse: it costs no disk) is refused at its first chunk:
    the check adds under 200 MB to the process's peak (it read it whole before: 2.37 GB)."""
    sparse = tmp_path / "sparse.txt"
    with sparse.open("wb") as f:
        f.truncate(2 * 10**9)
    _, added, said = _peak(tmp_path, sparse)
    assert "sparse.txt:1: a NUL byte: binary data" in said
    assert added < 200, added


@pytest.mark.slow
def test_the_cache_of_100_mb_of_text_is_under_500_mb(tmp_path):
    """100 MB of text as byte-level tokens: one uint8 id and one bool per token (it was two
    int64s, 1.6 GB)."""
    text = tmp_path / "big.txt"
    unit = open(json.__file__).read()
    with text.open("w") as f:
        for _ in range(100_000_000 // len(unit)):
            f.write(unit)
    _, _, cache = _peak(tmp_path, text)
    assert int(cache) < 500_000_000, cache


@pytest.mark.slow
def test_a_planned_data_run_names_its_data_not_the_stdlib(tmp_path):
    data = pairs(tmp_path / "p.jsonl", 40)
    args = ["--data", data, "--effective-batch", 8, "--steps", 1, "--seq-len", 16]
    out = cli("train", *args, "--budget", "300MB", "--out", tmp_path / "run").stdout
    assert f"on --data {data}" in out and "stdlib" not in out.split("\n", 3)[0], out[:2000]
