"""Memory sizes as users write them."""

import pytest

from gradaccum.memory import parse_bytes


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
    ],
)
def test_budgets_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["2 gigs", "", "-5MB", "GiB", "1.5", "0", "1e9", "2GiBs"])
def test_malformed_budgets_are_refused_with_the_accepted_forms(text):
    with pytest.raises(
        ValueError,
        match=r"(cannot read .* as a memory size; give bytes "
        r"\(2000000000\) or a number with a unit: B, KB, MB, GB, TB .* KiB, MiB, "
        r"GiB, TiB)|(must be whole)|(must be positive)",
    ):
        parse_bytes(text)
