"""Your own text as training data (``gradaccum train --data PATH``).

What is read: a ``.txt`` file (one document), a ``.jsonl`` file (a document per line in its
``text`` field, or ``prompt``/``completion`` pairs), or a folder of ``.txt``/``.jsonl``
files (sorted by name). Bad data is refused before training with the file, the line and
what was expected (``DataError``, a ValueError).

How it becomes sequences of ``seq_len`` tokens: documents are tokenized (the model's
tokenizer, or bytes for the byte-level GPT), joined with the end-of-text token and packed
into full sequences; a prompt/completion pair is one sequence, right-padded, whose prompt
tokens are labelled -100 so only the completion counts in the loss. A sequence's item count
is then exactly its tokens that count (``causal_lm_loss`` counts the shifted labels).

The held-out split takes a seeded share of the sequences, so the same data and ``--seed``
give the same split. The sequences are cached in one file keyed by the data's bytes, the
tokenizer and the settings: a resumed run, or a second run on the same data, reads them
back instead of tokenizing again.
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import json
import math
import os
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradaccum.app.recipes.base import epoch_order, held_out_loss

__all__ = [
    "DataError",
    "Encoder",
    "SequenceData",
    "byte_encoder",
    "load_sequences",
    "read_records",
    "save_cache",
]

IGNORE = -100
SUFFIXES = (".txt", ".jsonl")


class DataError(ValueError):
    """Data that cannot be trained on: one line naming the file, the line and the problem."""


@dataclass(frozen=True)
class Encoder:
    """How text becomes token ids for one model: ``encode``, the end-of-text id that joins
    documents, the id padding uses (its label is -100 whatever it is), the longest sequence
    the model takes, and a ``name`` that identifies the tokenizer in the cache key."""

    encode: Callable[[str], Sequence[int]]  # a list of ids, or bytes (the byte-level GPT)
    eos: int
    pad: int
    max_len: int
    name: str


def byte_encoder(max_len: int) -> Encoder:
    """UTF-8 bytes: the byte-level GPT's vocabulary. NUL (0) ends a document and pads."""
    return Encoder(lambda text: text.encode("utf-8"), 0, 0, max_len, "bytes")


# -- reading ------------------------------------------------------------------------------------


def _files(path: Path) -> list[Path]:
    if not path.exists():
        if path.is_symlink():
            raise DataError(f"--data {path}: {_broken_link(path)}")
        raise DataError(f"--data {path}: no such file or directory")
    if path.is_dir():
        root, entries = path.resolve(), list(path.rglob("*"))  # one walk of the folder
        for entry in entries:
            if not entry.is_symlink():
                continue
            try:
                target = entry.resolve(strict=True)
            except (OSError, RuntimeError):
                raise DataError(f"--data {path}: {entry} {_broken_link(entry)}") from None
            if not target.is_relative_to(root):
                raise DataError(
                    f"--data {path}: {entry} is a link to {target}, outside the "
                    "folder; copy what it names into the folder, or give it as --data itself"
                )
        files = sorted(p for p in entries if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise DataError(f"--data {path}: the folder holds no .txt or .jsonl file")
        return files
    if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block its read forever
        raise DataError(
            f"--data {path}: {_kind(path)}, not a file: give a .txt or .jsonl file or a "
            "folder of them (save a stream to a file first)"
        )
    if path.suffix not in SUFFIXES:
        raise DataError(f"--data {path}: expected a .txt or .jsonl file or a folder of them")
    return [path]


def _broken_link(link: Path) -> str:
    """What is wrong with a symbolic link that does not lead to a file."""
    try:
        link.resolve(strict=True)
    except RuntimeError:  # Python's own word for a loop (3.11: "Symlink loop")
        return "is a symbolic link loop (it leads back to itself); remove or repoint it"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symbolic link loop (it leads back to itself); remove or repoint it"
        return f"is a symbolic link to {os.readlink(link)}, which does not exist"
    return "is a symbolic link that cannot be followed"


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    for test, name in kinds:
        if test(mode):
            return f"is {name}"
    return "is not a regular file"


CHUNK = 1 << 20  # files are checked and hashed a MiB at a time, never read whole for it


def _scan(file: Path, digest: Any) -> None:
    """Check that ``file`` is UTF-8 text (no NUL byte, not empty) and feed its bytes to
    ``digest``, streaming: a binary file of any size is refused at its first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines, blank = 0, 1, True
    try:
        with file.open("rb") as f:
            while chunk := f.read(CHUNK):
                nul = chunk.find(b"\x00")
                if nul >= 0:
                    line = lines + chunk[:nul].count(b"\n")
                    raise DataError(f"{file}:{line}: a NUL byte: binary data, expected UTF-8 text")
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    _not_utf8(file, chunk, err, offset, lines)
                blank = blank and not chunk.strip()
                digest.update(chunk)
                offset, lines = offset + len(chunk), lines + chunk.count(b"\n")
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as err:
                _not_utf8(file, b"", err, offset, lines)
    except OSError as err:
        raise DataError(f"{file}: cannot be read ({err.strerror or err})") from None
    if blank:
        raise DataError(f"{file}: the file is empty")


def _not_utf8(file: Path, chunk: bytes, err: UnicodeDecodeError, offset: int, lines: int):
    """Where the incremental decoder found bytes that are not UTF-8 (its ``err.start`` may
    point into bytes it held back from the previous chunk: before this chunk's start)."""
    start = max(0, err.start - (len(err.object) - len(chunk)))
    line = lines + chunk[:start].count(b"\n")
    bad = err.object[err.start]
    raise DataError(
        f"{file}:{line}: not UTF-8 text (byte 0x{bad:02x} at offset {offset + start})"
    ) from None


def _text(path: Path) -> str:
    """A file ``_scan`` checked, as text."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None


def read_records(path: str | Path, text_field: str = "text") -> tuple[str, list[Any]]:
    """``("text", [document, ...])`` or ``("pairs", [(prompt, completion), ...])``, read from
    ``path``; a folder's files must agree on the kind."""
    files = _files(Path(path))
    for file in files:
        _scan(file, hashlib.sha256())  # checked as load_sequences checks it
    return _records(files, text_field)


def _records(files: list[Path], text_field: str) -> tuple[str, list[Any]]:
    kinds, records = set(), []
    for file in files:
        text = _text(file)
        if file.suffix == ".txt":
            kinds.add("text")
            records.append(text)
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            kind, record = _json_record(file, number, line, text_field)
            kinds.add(kind)
            records.append(record)
        if len(kinds) > 1:
            raise DataError(
                f"{file}: mixes documents ({text_field!r}) and prompt/completion pairs; use one "
                "kind per run"
            )
    return kinds.pop(), records


def _json_record(file: Path, number: int, line: str, text_field: str) -> tuple[str, Any]:
    where = f"{file}:{number}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj.get(key), str):
                raise DataError(f"{where}: a prompt/completion pair needs a string {key!r} field")
        if not obj["completion"]:
            raise DataError(f"{where}: empty 'completion': nothing would count in the loss")
        return "pairs", (obj["prompt"], obj["completion"])
    if text_field not in obj:
        fields = ", ".join(map(repr, sorted(obj))) or "none"
        raise DataError(
            f"{where}: no {text_field!r} field (fields: {fields}); name it with --text-field, "
            "or give 'prompt' and 'completion'"
        )
    if not isinstance(obj[text_field], str):
        raise DataError(
            f"{where}: field {text_field!r} must be a string, got {type(obj[text_field]).__name__}"
        )
    return "text", obj[text_field]


# -- sequences ----------------------------------------------------------------------------------


def _tensor(tokens: Sequence[int]) -> torch.Tensor:
    """A document's ids as a tensor; bytes without a Python int per byte."""
    if isinstance(tokens, (bytes, bytearray)):
        if not tokens:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(tokens), dtype=torch.uint8).long()
    return torch.tensor(tokens, dtype=torch.long)


def _pack(documents: list[Sequence[int]], seq_len: int, eos: int, pad: int):
    """Documents joined by ``eos`` and cut into sequences of ``seq_len``; the last one
    padded (labels -100)."""
    end = torch.tensor([eos])
    flat = torch.cat([t for doc in documents for t in (_tensor(doc), end)])
    n = math.ceil(len(flat) / seq_len)
    ids = torch.full((n, seq_len), pad, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    ids.view(-1)[: len(flat)] = flat
    labels.view(-1)[: len(flat)] = flat
    return ids, labels


def _pairs(
    pairs: list[tuple[Sequence[int], Sequence[int]]], seq_len: int, eos: int, pad: int, path
):
    ids = torch.full((len(pairs), seq_len), pad, dtype=torch.long)
    labels = torch.full((len(pairs), seq_len), IGNORE, dtype=torch.long)
    for row, (prompt, completion) in enumerate(pairs):
        tokens = [*prompt, *completion, eos]
        if len(tokens) > seq_len:
            raise DataError(
                f"{path}: pair {row + 1}: prompt and completion are {len(tokens)} tokens, "
                f"longer than --seq-len {seq_len}"
            )
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, len(prompt) : len(tokens)] = torch.tensor([*completion, eos])
    return ids, labels


def _split(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Sequence indices for training and held out: a seeded permutation, at least one held
    out when the fraction is positive."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = min(n - 1, max(1, round(n * eval_fraction))) if eval_fraction > 0 else 0
    return sorted(order[held:]), sorted(order[:held])


def _fingerprint(path: Path, files: list[Path], *settings: Any) -> str:
    """The cache key: the settings, each file's name and bytes (each checked as text while
    it is hashed, streaming)."""
    digest = hashlib.sha256(repr(settings).encode())
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        _scan(file, digest)
    return digest.hexdigest()[:16]


def load_sequences(
    path: str | Path,
    encoder: Encoder,
    *,
    seq_len: int,
    eval_fraction: float,
    seed: int,
    text_field: str = "text",
    cache: Path | None = None,
) -> dict[str, Any]:
    """``{"train": (ids, labels), "eval": (ids, labels), "kind": ..., "key": ...}`` from the
    data at ``path``; read from ``cache`` (a folder) when it holds this data's sequences."""
    path = Path(path)
    if seq_len > encoder.max_len:
        raise DataError(
            f"--seq-len {seq_len} is longer than the model takes ({encoder.max_len} positions)"
        )
    files = _files(path)
    key = _fingerprint(path, files, encoder.name, seq_len, eval_fraction, seed, text_field)
    cached = cache / f"data-{key}.pt" if cache is not None else None
    if cached is not None and cached.is_file():
        return _read_cache(cached)
    kind, records = _records(files, text_field)
    encode = _with_progress(encoder.encode, sum(map(_size, records)))
    if kind == "text":
        ids, labels = _pack([encode(t) for t in records], seq_len, encoder.eos, encoder.pad)
    else:
        pairs = [(encode(p), encode(c)) for p, c in records]
        ids, labels = _pairs(pairs, seq_len, encoder.eos, encoder.pad, path)
    train_rows, eval_rows = _split(len(ids), eval_fraction, seed)
    return {
        "train": (ids[train_rows], labels[train_rows]),
        "eval": (ids[eval_rows], labels[eval_rows]),
        "kind": kind,
        "key": key,
    }


CACHE_FORMAT = "gradaccum.data/2"  # ids in the smallest integer type that holds them


def _compact(ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache stores of a split: the ids in the narrowest type that holds them
    (uint8 for bytes) and which positions count (labels are the ids there, -100 elsewhere)."""
    top = int(ids.max()) if ids.numel() else 0
    dtype = torch.uint8 if top < 2**8 else torch.int16 if top < 2**15 else torch.int32
    return ids.to(dtype), labels != IGNORE


def _expanded(ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.long()
    return ids, ids.masked_fill(~counts, IGNORE)


def _read_cache(cached: Path) -> dict[str, Any]:
    """A run folder's data cache, read safely (weights_only): a file that does not load so
    is refused in one line, never unpickled (torch's own message would suggest it). A cache
    of gradaccum 0.7 or before holds the int64 ids and labels themselves."""
    try:
        loaded = torch.load(cached, weights_only=True)
        if loaded.get("format") == CACHE_FORMAT:
            loaded = {
                **{k: v for k, v in loaded.items() if k != "format"},
                "train": _expanded(*loaded["train"]),
                "eval": _expanded(*loaded["eval"]),
            }
        return loaded
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same answer
        raise DataError(
            f"{cached} cannot be read safely ({type(err).__name__}): it is damaged or not a "
            "gradaccum data cache; delete it to tokenize --data again"
        ) from None


def save_cache(loaded: dict[str, Any], cache: Path) -> Path:
    """Write ``loaded`` where ``load_sequences(..., cache=cache)`` finds it (atomically)."""
    path = cache / f"data-{loaded['key']}.pt"
    if not path.is_file():
        tmp = path.with_name(path.name + ".tmp")
        compact = {
            **loaded,
            "format": CACHE_FORMAT,
            "train": _compact(*loaded["train"]),
            "eval": _compact(*loaded["eval"]),
        }
        try:
            torch.save(compact, tmp)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as err:  # torch.save's writer raises RuntimeError
            from gradaccum.app.folder import write_failure

            tmp.unlink(missing_ok=True)
            raise DataError(f"cannot write {path}: {write_failure(err)}") from None
    return path


def _size(record: Any) -> int:
    return len(record) if isinstance(record, str) else len(record[0]) + len(record[1])


def _with_progress(encode: Callable[[str], list[int]], total_chars: int):
    """``encode`` with a progress bar on a terminal for large data (over 10M characters)."""
    if total_chars < 10_000_000 or not sys.stderr.isatty():
        return encode
    from tqdm import tqdm

    bar = tqdm(total=total_chars, unit="char", unit_scale=True, desc="tokenizing")

    def counted(text: str) -> list[int]:
        bar.update(len(text))
        return encode(text)

    return counted


class SequenceData:
    """The training data of a run: step ``k``'s sequences are a pure function of the seed and
    ``k`` (an epoch is a seeded permutation; its last step takes what is left, a ragged last
    window), so a resumed run reads exactly what an uninterrupted one would."""

    def __init__(
        self,
        loaded: dict[str, Any],
        seed: int,
        logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ) -> None:
        self.ids, self.labels = loaded["train"]
        self.eval_ids, self.eval_labels = loaded["eval"]
        self.seed, self.logits = seed, logits

    def epoch_samples(self) -> int:
        return len(self.ids)

    def sample(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` training sequences, for the planner: every sequence has the same shape."""
        rows = torch.arange(n) % len(self.ids)
        return {"input_ids": self.ids[rows], "labels": self.labels[rows]}

    def batch(self, position: int, size: int) -> dict[str, torch.Tensor]:
        order = epoch_order(len(self.ids), self.seed, position, size)
        return {"input_ids": self.ids[order], "labels": self.labels[order]}

    def evaluate(
        self, model: torch.nn.Module, micro_size: int, limit: int | None = None
    ) -> dict[str, float]:
        if len(self.eval_ids) == 0:
            return {}
        ids, labels = self.eval_ids[:limit], self.eval_labels[:limit]
        return held_out_loss(model, self.logits, ids, labels, micro_size)
