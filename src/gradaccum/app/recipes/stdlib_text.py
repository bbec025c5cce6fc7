"""A byte-level text corpus from the Python standard library's own source files.

Every Python installation has them, so the built-in recipes need no download. Files are
read in sorted order, so the corpus is the same on every run of one Python version.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

PAD = 0  # NUL never appears in source text, so it is free to mean padding
IGNORE = -100


def stdlib_dir() -> Path:
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise FileNotFoundError(f"the standard library's source directory {path} does not exist")
    return path


@functools.cache  # planning, data and evaluation all read it; bytes are immutable
def corpus_bytes(max_bytes: int = 2_000_000) -> bytes:
    """Up to ``max_bytes`` of standard-library source, files in sorted order (tests skipped)."""
    chunks, total = [], 0
    root = stdlib_dir()
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes().replace(b"\x00", b"")
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under {root}")
    return b"".join(chunks)[:max_bytes]


def padded_lines_batch(
    data: bytes, n: int, max_len: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """``n`` byte sequences of varying length (whole lines from a random start), right-padded
    to ``max_len``, with padding labelled ``IGNORE``: the case where per-micro-batch mean
    losses go wrong."""
    ids = torch.full((n, max_len), PAD, dtype=torch.long)
    labels = torch.full((n, max_len), IGNORE, dtype=torch.long)
    starts = torch.randint(0, len(data) - max_len, (n,), generator=generator).tolist()
    lengths = torch.randint(2, max_len + 1, (n,), generator=generator).tolist()
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        seq = torch.tensor(list(data[start : start + length]), dtype=torch.long)
        ids[row, : len(seq)] = seq
        labels[row, : len(seq)] = seq
    return {"input_ids": ids, "labels": labels}


def full_length_batch(data: bytes, n: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` windows of exactly ``length`` bytes from random places: no padding, the largest
    shape the model sees (what memory is planned for)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length, (n,), generator=gen).tolist()
    ids = torch.tensor([list(data[s : s + length]) for s in starts], dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}
