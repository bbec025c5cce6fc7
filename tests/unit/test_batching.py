"""split, windows and shard against direct torch computations."""

from collections import OrderedDict, namedtuple

import pytest
import torch

import gradaccum as ga
from gradaccum.batching import batch_size, largest_share


def test_split_tensor_keeps_every_sample_once():
    x = torch.arange(10 * 3).reshape(10, 3)
    parts = ga.split(x, 4)
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts), x)
    assert all(p.data_ptr() >= x.data_ptr() for p in parts)  # views, not copies


@pytest.mark.parametrize("micro", [1, 3, 7, 10, 50])
def test_split_containers(micro):
    Pair = namedtuple("Pair", "inputs labels")
    n = 10
    x, y = torch.randn(n, 2), torch.arange(n)
    batches = {
        "tuple": (x, y),
        "list": [x, y],
        "dict": {"x": x, "y": y},
        "ordered": OrderedDict(x=x, y=y),
        "namedtuple": Pair(x, y),
        "nested": {"pair": (x, y), "extra": [y], "none": None},
    }
    for name, batch in batches.items():
        parts = ga.split(batch, micro)
        assert sum(batch_size(p) for p in parts) == n, name
        assert type(parts[0]) is type(batch), name
        labels = [
            p["pair"][1] if name == "nested" else (p["y"] if isinstance(p, dict) else p[1])
            for p in parts
        ]
        assert torch.equal(torch.cat(labels), y), name
    assert parts[0]["none"] is None


def test_split_batch_encoding_stays_a_batch_encoding():
    from transformers import BatchEncoding

    enc = BatchEncoding(
        {
            "input_ids": torch.arange(14).reshape(7, 2),
            "attention_mask": torch.ones(7, 2, dtype=torch.long),
        }
    )
    parts = ga.split(enc, 3)
    assert [type(p) for p in parts] == [BatchEncoding] * 3
    assert [p["input_ids"].shape[0] for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), enc["input_ids"])


def test_split_refuses_what_it_cannot_split():
    with pytest.raises(
        ValueError, match=r"disagree on the number of samples \(batch\[0\]: 4, batch\[1\]: 5\)"
    ):
        ga.split((torch.zeros(4), torch.zeros(5)), 2)
    with pytest.raises(ValueError, match=r"batch\['x'\] is a 0-dim tensor"):
        ga.split({"x": torch.tensor(1.0)}, 2)
    with pytest.raises(TypeError, match=r"batch\[1\] is a str"):
        ga.split((torch.zeros(4), "text"), 2)
    with pytest.raises(ValueError, match="holds no tensor"):
        ga.split((None,), 2)
    assert ga.split(torch.zeros(0, 3), 2) == []


@pytest.mark.parametrize("size,world", [(45, 2), (7, 3), (4, 4), (64, 8)])
def test_shard_splits_a_global_batch_exactly_across_processes(size, world):
    batch = {"x": torch.arange(size), "y": torch.arange(size) * 10}
    shares = [ga.shard(batch, rank, world) for rank in range(world)]
    sizes = [len(s["x"]) for s in shares]
    assert sum(sizes) == size and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger shares go to the first ranks
    # the per-rank batch a plan is made for is the fullest rank's share, as shard makes it
    assert largest_share(size, world) == max(sizes)
    # every sample once, in order, rows kept together
    assert torch.equal(torch.cat([s["x"] for s in shares]), batch["x"])
    assert torch.equal(torch.cat([s["y"] for s in shares]), batch["y"])


def test_shard_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="a batch of 3 samples cannot be split across 4"):
        ga.shard(torch.zeros(3, 2), 0, 4)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\), got 2"):
        ga.shard(torch.zeros(3, 2), 2, 2)
    with pytest.raises(ValueError, match="world must be an integer >= 1, got 0"):
        ga.shard(torch.zeros(3, 2), 0, 0)
    with pytest.raises(ValueError, match="a batch of 3 samples cannot be split across 4"):
        largest_share(3, 4)


def test_windows_keeps_the_last_partial_window_and_is_lazy():
    assert list(ga.windows(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(ga.windows(range(6), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(ga.windows([], 3)) == []

    def endless():
        i = 0
        while True:
            yield i
            i += 1

    first = next(iter(ga.windows(endless(), 4)))
    assert first == [0, 1, 2, 3]
