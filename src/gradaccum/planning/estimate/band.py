"""How far published GPU runs of each kind measured from their estimates: the band the
estimate states beside its number (docs/planning.md, "The band").

``band.json`` beside this module is written by bench/published.py from its last run
(bench/results/published.md): for each kind of run ("full", "lora", "qlora"), how many
published rows were asked and the lowest and highest of measured / estimate - 1 among them,
each against the row's own meter. Nothing here measures; it reads what the benchmark wrote.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from gradaccum.memory import format_bytes

__all__ = ["KINDS", "band", "kind_of", "line"]

KINDS = ("full", "lora", "qlora")


def kind_of(lora: Any, quantize: Any) -> str:
    """The kind of run a question is: a quantized base under LoRA, LoRA, or full training."""
    if quantize:
        return "qlora"
    return "lora" if lora else "full"


def band(kind: str) -> dict[str, Any] | None:
    """``{"rows", "low", "high", "source"}`` for ``kind``, or None where no published run of
    that kind was asked (or the file is missing: a checkout without the benchmark's data)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    try:
        text = resources.files(__package__).joinpath("band.json").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        return None
    data = json.loads(text)
    got = data.get("kinds", {}).get(kind)
    return None if not got else {**got, "source": data["source"]}


def line(band: dict[str, Any], total: int, budget: int | None) -> str:
    """What published runs of ``band["kind"]`` measured against their estimates, and a window
    of ``total`` bytes at the band's high end against ``budget``, in one line."""
    what = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}[band["kind"]]
    high = total * (1 + band["high"])
    verdict = ""
    if budget is not None:
        verdict = "; fits the budget" if high <= budget else "; does not fit the budget"
    return (
        f"band: {band['rows']} published {what} runs measured {band['low']:+.1%} to "
        f"{band['high']:+.1%} of their estimates ({band['source']}); at {band['high']:+.1%} "
        f"this window would be {format_bytes(int(high))}{verdict}"
    )
