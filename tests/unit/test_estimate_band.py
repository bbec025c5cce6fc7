"""gradaccum.planning.estimate.band: the band bench/published.py wrote (band.json), read
for the kind of run asked, and the line the estimate prints with it."""

from __future__ import annotations

import pytest

from gradaccum.planning.estimate.band import KINDS, band, kind_of, line


def test_the_kind_of_a_question():
    assert kind_of(None, None) == "full"
    assert kind_of("16", None) == "lora"
    assert kind_of("16", "nf4") == "qlora"
    with pytest.raises(ValueError, match="kind must be one of"):
        band("int8")


def test_every_kind_written_holds_rows_and_an_ordered_range_from_the_benchmark():
    written = [band(k) for k in KINDS]
    assert any(written), "band.json holds no kind: run bench/published.py"
    for got in filter(None, written):
        assert got["rows"] >= 1 and got["low"] <= got["high"]
        assert got["source"].startswith("bench/results/published.md at ")


def test_the_line_says_the_range_and_the_window_at_its_high_end():
    said = {"kind": "lora", "rows": 40, "low": -0.05, "high": 0.2, "source": "here"}
    over = line(said, 10 * 2**30, 11 * 2**30)
    assert over.startswith("band: 40 published LoRA runs measured -5.0% to +20.0%")
    assert "this window would be 12.0 GiB; does not fit the budget" in over
    assert line(said, 9 * 2**30, 11 * 2**30).endswith("; fits the budget")
