"""--data: reading your own text, the sequences it becomes, the counts that enter the loss."""

import json
from collections import Counter

import pytest
import torch

import gradaccum as ga
from gradaccum.app.recipes.userdata import (
    DataError,
    SequenceData,
    byte_encoder,
    load_sequences,
    read_records,
    save_cache,
)


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_completion_pairs_count_only_completion_tokens(tmp_path):
    """Bytes: "ab" + "xyz" + end-of-text -> 3 completion tokens that count after the shift
    (positions predicting x, y, z are labelled; the end-of-text token counts too: 4)."""
    data = jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "completion": "xyz"}] * 3)
    loaded = load_sequences(data, byte_encoder(16), seq_len=8, eval_fraction=0, seed=0)
    ids, labels = loaded["train"]
    assert ids.shape == (3, 8)
    assert ids[0, :6].tolist() == [*b"abxyz", 0]
    assert labels[0].tolist() == [-100, -100, *b"xyz", 0, -100, -100]
    logits = torch.zeros(3, 8, 256, requires_grad=True)
    _, count = ga.causal_lm_loss(logits, labels)
    assert int(count) == 3 * 4  # x, y, z and the end of text, per pair


def test_documents_are_packed_into_full_sequences(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("world!")
    loaded = load_sequences(tmp_path, byte_encoder(16), seq_len=4, eval_fraction=0, seed=0)
    ids, labels = loaded["train"]
    # "hello" EOT "world!" EOT = 13 tokens -> 4 sequences of 4, the last padded
    stream = [*b"hello", 0, *b"world!", 0]
    assert sorted(map(tuple, ids.tolist())) == sorted(
        map(tuple, [stream[0:4], stream[4:8], stream[8:12], [stream[12], 0, 0, 0]])
    )
    assert int((labels != -100).sum()) == len(stream)


def test_the_held_out_split_is_seeded_and_disjoint(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"text": f"document {i}"} for i in range(50)])
    a = load_sequences(data, byte_encoder(64), seq_len=8, eval_fraction=0.2, seed=3)
    b = load_sequences(data, byte_encoder(64), seq_len=8, eval_fraction=0.2, seed=3)
    c = load_sequences(data, byte_encoder(64), seq_len=8, eval_fraction=0.2, seed=4)
    assert torch.equal(a["eval"][0], b["eval"][0]) and not torch.equal(a["eval"][0], c["eval"][0])
    # every sequence once, in one of the two parts
    whole = load_sequences(data, byte_encoder(64), seq_len=8, eval_fraction=0, seed=3)["train"][0]
    parts = torch.cat([a["train"][0], a["eval"][0]])
    assert Counter(map(tuple, parts.tolist())) == Counter(map(tuple, whole.tolist()))
    assert len(a["eval"][0]) == round(len(whole) * 0.2)


def test_the_cache_is_read_back_and_keyed_by_the_data(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"body": "some text here"}] * 10)
    first = load_sequences(
        data, byte_encoder(64), seq_len=8, eval_fraction=0.1, seed=0, text_field="body"
    )
    path = save_cache(first, tmp_path)
    again = load_sequences(
        data,
        byte_encoder(64),
        seq_len=8,
        eval_fraction=0.1,
        seed=0,
        text_field="body",
        cache=tmp_path,
    )
    assert torch.equal(again["train"][0], first["train"][0]) and path.is_file()
    jsonl(data, [{"body": "other text"}] * 10)
    changed = load_sequences(
        data,
        byte_encoder(64),
        seq_len=8,
        eval_fraction=0.1,
        seed=0,
        text_field="body",
        cache=tmp_path,
    )
    assert changed["key"] != first["key"]


def test_batches_are_a_pure_function_of_the_position_with_a_ragged_epoch_end(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"text": f"line {i:03d}"} for i in range(30)])
    loaded = load_sequences(data, byte_encoder(64), seq_len=10, eval_fraction=0, seed=0)
    one = SequenceData(loaded, seed=1, logits=lambda m, x: m(x))
    two = SequenceData(loaded, seed=1, logits=lambda m, x: m(x))
    n = len(one.ids)
    assert one.epoch_samples() == n
    position, rows = 0, []
    while position < n:  # windows of 8, then the epoch's ragged rest
        rows.append(one.batch(position, 8)["input_ids"])
        position += len(rows[-1])
    assert [len(r) for r in rows] == [8] * (n // 8) + ([n % 8] if n % 8 else [])
    assert len({tuple(r.tolist()) for r in torch.cat(rows)}) == n  # each sequence once
    # the stream does not depend on the window sizes that cut it
    assert torch.equal(
        torch.cat([one.batch(0, 3)["input_ids"], one.batch(3, 5)["input_ids"]]), rows[0]
    )
    assert torch.equal(one.batch(40, 8)["input_ids"], two.batch(40, 8)["input_ids"])


@pytest.mark.parametrize(
    "write, message",
    [
        (lambda p: p.write_text(""), "the file is empty"),
        (lambda p: p.write_bytes(b'{"text": "a"}\n\xff\xfe'), ":2: not UTF-8 text"),
        (lambda p: p.write_bytes(b'{"text": "a"}\n{"text": "\x00"}\n'), ":2: a NUL byte"),
        (lambda p: p.write_text('{"text": "a"}\nnot json\n'), ":2: not JSON"),
        (lambda p: p.write_text('{"text": "a"}\n{"body": "b"}\n'), ":2: no 'text' field"),
        (lambda p: p.write_text('{"prompt": "a"}\n'), ":1: a prompt/completion pair needs"),
        (lambda p: p.write_text('["a"]\n'), ":1: expected a JSON object, got list"),
        (lambda p: p.write_text('{"text": 3}\n'), ":1: field 'text' must be a string"),
    ],
)
def test_bad_data_names_the_file_and_line(tmp_path, write, message):
    path = tmp_path / "bad.jsonl"
    write(path)
    with pytest.raises(DataError, match=message) as err:
        read_records(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_sequences_the_model_cannot_take_are_refused(tmp_path):
    data = jsonl(tmp_path / "p.jsonl", [{"prompt": "a" * 10, "completion": "b" * 10}])
    with pytest.raises(DataError, match="longer than the model takes"):
        load_sequences(data, byte_encoder(16), seq_len=32, eval_fraction=0, seed=0)
    with pytest.raises(DataError, match=r"pair 1: prompt and completion are 21 tokens"):
        load_sequences(data, byte_encoder(16), seq_len=16, eval_fraction=0, seed=0)
    with pytest.raises(DataError, match="expected a .txt or .jsonl"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_sequences(tmp_path / "x.csv", byte_encoder(16), seq_len=8, eval_fraction=0, seed=0)


def test_text_is_checked_streaming_across_chunk_boundaries(tmp_path, monkeypatch):
    """Checked a chunk at a time (8 bytes here): a NUL byte, a byte that is not UTF-8 and a
    multi-byte character cut by a chunk's end are each found, and named at their line."""
    from gradaccum.app.recipes import userdata

    monkeypatch.setattr(userdata, "CHUNK", 8)
    path = tmp_path / "t.txt"
    path.write_bytes("line one\nline twö\nthree ü\n".encode())  # ö and ü span chunks
    assert read_records(path) == ("text", ["line one\nline twö\nthree ü\n"])
    path.write_bytes(b"line one\nline two\nthr\x00ee\n")
    with pytest.raises(DataError, match=r"t.txt:3: a NUL byte"):
        read_records(path)
    path.write_bytes(b"line one\nline two\nthree \xc3")  # a character cut by the file's end
    with pytest.raises(DataError, match=r"t.txt:3: not UTF-8 text"):
        read_records(path)
    path.write_bytes(b"line one\nline two\n\xff three\n")
    with pytest.raises(DataError, match=r"t.txt:3: not UTF-8 text \(byte 0xff at offset 18\)"):
        read_records(path)


def test_a_link_out_of_the_data_folder_is_refused_and_one_inside_it_is_read(tmp_path):
    outside = tmp_path / "private.txt"
    outside.write_text("not for training\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("alpha\n")
    (data / "also-a.txt").symlink_to(data / "a.txt")  # inside: read
    assert read_records(data) == ("text", ["alpha\n", "alpha\n"])
    (data / "b.txt").symlink_to(outside)
    with pytest.raises(DataError, match=r"b.txt is a link to .*private.txt, outside the folder"):
        read_records(data)
    (data / "b.txt").unlink()
    (data / "more").symlink_to(tmp_path, target_is_directory=True)  # a folder out of it
    with pytest.raises(DataError, match="outside the folder"):
        read_records(data)


def _within(seconds, fn, *args):
    """fn(*args) in a thread: what it raised, or a failure where it has not returned in
    ``seconds`` (a read that blocks forever must fail the test, not hang it)."""
    import threading

    caught = []

    def run():
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001
            caught.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} still running after {seconds} s"
    return caught[0] if caught else None


def test_a_fifo_given_as_data_is_refused_not_read(tmp_path):
    """Given a FIFO, the read blocked in open() forever with no output (issue 58)."""
    import os

    fifo = tmp_path / "stream.txt"
    os.mkfifo(fifo)
    err = _within(60, read_records, fifo)  # a hang guard, not a timing: a refusal is a stat
    assert isinstance(err, DataError) and "is a FIFO (named pipe), not a file" in str(err)


def test_symbolic_link_loops_are_named_as_loops(tmp_path):
    """A loop inside the folder was RuntimeError: Symlink loop (a traceback); --data itself a
    loop said 'no such file' (issue 58)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("alpha\n")
    (data / "loop.txt").symlink_to(data / "loop.txt")
    with pytest.raises(DataError, match=r"loop.txt is a symbolic link loop"):
        read_records(data)
    with pytest.raises(DataError, match=r"--data .*loop.txt: is a symbolic link loop"):
        read_records(data / "loop.txt")
    (data / "loop.txt").unlink()
    (data / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(DataError, match=r"gone.txt is a symbolic link to .*nowhere.txt, which"):
        read_records(data)


@pytest.mark.parametrize("vocab, dtype", [(256, torch.uint8), (30_000, torch.int16)])
def test_the_cache_holds_ids_in_the_narrowest_type_and_reads_back_exactly(tmp_path, vocab, dtype):
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": "ab" * i, "completion": "xyz"} for i in range(1, 9)]
    jsonl(data, rows + [{"prompt": "q", "completion": "r"}])
    ids_of = {c: (ord(c) * 97) % vocab for c in "abxyzqr"}
    encoder = ga_encoder(lambda text: [ids_of[c] for c in text], vocab)
    first = load_sequences(data, encoder, seq_len=24, eval_fraction=0.2, seed=0)
    path = save_cache(first, tmp_path)
    stored = torch.load(path, weights_only=True)
    assert stored["train"][0].dtype == dtype and stored["train"][1].dtype == torch.bool
    again = load_sequences(data, encoder, seq_len=24, eval_fraction=0.2, seed=0, cache=tmp_path)
    for split in ("train", "eval"):
        for a, b in zip(first[split], again[split], strict=True):
            assert a.dtype == b.dtype == torch.long and torch.equal(a, b)


def test_a_cache_of_gradaccum_0_7_still_reads(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("some text to pack\n" * 20)
    first = load_sequences(data, byte_encoder(64), seq_len=16, eval_fraction=0.1, seed=0)
    torch.save(first, tmp_path / f"data-{first['key']}.pt")  # as 0.7 wrote it: int64 ids
    again = load_sequences(
        data, byte_encoder(64), seq_len=16, eval_fraction=0.1, seed=0, cache=tmp_path
    )
    assert all(torch.equal(a, b) for a, b in zip(first["train"], again["train"], strict=True))


def ga_encoder(encode, vocab):
    from gradaccum.app.recipes.userdata import Encoder

    return Encoder(encode, eos=vocab - 1, pad=vocab - 1, max_len=64, name=f"test {vocab}")
