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
