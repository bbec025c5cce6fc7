"""Memory sizes as users write them, and the live-tensor meter."""

import pytest
import torch

from gradaccum.memory import LiveTensorBytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * 2**30),
        ("1500MB", 1_500_000_000),
        ("123456789", 123456789),
        ("1.5GB", 1_500_000_000),
        ("512 mib", 512 * 2**20),
        ("64KiB", 65536),
        (4096, 4096),
        ("1e9", 1_000_000_000),  # as YAML and TOML write large numbers
        ("1.5e3MB", 1_500_000_000),
    ],
)
def test_budgets_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["2 gigs", "", "-5MB", "GiB", "1.5", "0", "1e-3", "2GiBs"])
def test_malformed_budgets_are_refused_with_the_accepted_forms(text):
    with pytest.raises(
        ValueError,
        match=r"(cannot read .* as a memory size; give bytes "
        r"\(2000000000\) or a number with a unit: B, KB, MB, GB, TB .* KiB, MiB, "
        r"GiB, TiB)|(must be whole)|(must be positive)",
    ):
        parse_bytes(text)


def test_live_tensor_bytes_count_new_storages_not_views_or_in_place_results():
    """A frozen weight's transpose in backward and a parameter the optimizer updates in place
    alias tensors that exist before the measurement: they once counted as new memory, as
    much again as the weights themselves."""
    weight = torch.zeros(256, 64)
    with LiveTensorBytes() as live:
        weight.t()
        weight.add_(1.0)
        weight[:8].view(-1)
    assert live.peak == 0
    with LiveTensorBytes() as live:
        fresh = torch.ones(100, 10)  # 4000 bytes
        fresh.t().mul_(2.0)
        fresh.split(10)
    assert live.peak == 4000


def test_training_memory_sees_each_phase_apart_and_the_run_whole():
    """A phase's peak is read from the run's baseline with the high-water mark reset at its
    start: a small phase after a large one reads small, and peak() still holds the large."""
    from gradaccum.memory import TrainingMemory

    model = torch.nn.Linear(4, 4)
    memory = TrainingMemory(model, "cpu")
    big, small = 64 * 2**20, 4 * 2**20
    with memory.phase("training"):
        x = torch.ones(big // 4)  # float32, every page touched
        del x
    with memory.phase("evaluation"):
        y = torch.ones(small // 4)
        del y
    # (the resident set is the whole process's: other pages come and go by a few hundred KiB)
    assert memory.phases["training"] >= 0.95 * big
    # the evaluation reads what it raised memory to, not the training's high-water mark
    assert memory.phases["evaluation"] < memory.phases["training"] - big // 2
    assert memory.phases["evaluation"] >= 0.8 * small
    assert memory.peak() >= memory.phases["training"]


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_resident_counts_what_the_work_left_held_and_training_memory_carries_it():
    """What work left resident (kept) counts; what it freed does not; TrainingMemory adds
    what it is told the process carries to every peak, phases included."""
    from gradaccum.memory import Resident, TrainingMemory

    size = 64 * 2**20
    with Resident() as freed:
        x = torch.ones(size // 4)
        del x
    with Resident() as kept:
        y = torch.ones(size // 4)
    assert kept.grown >= 0.95 * size
    assert freed.grown < size // 4
    with Resident("meta") as elsewhere:  # not the CPU: a GPU's allocator counts use itself
        w = torch.ones(size // 4)
    assert elsewhere.grown == 0
    del w
    model = torch.nn.Linear(4, 4)
    plain = TrainingMemory(model, "cpu")
    carried = TrainingMemory(model, "cpu", carried=kept.grown)
    for memory in (plain, carried):
        with memory.phase("training"):
            z = torch.ones(2**20)
            del z
    assert carried.peak() - plain.peak() > 0.9 * kept.grown
    assert carried.phases["training"] - plain.phases["training"] > 0.9 * kept.grown
    del y
