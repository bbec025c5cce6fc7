"""The plan's fresh processes speak one protocol (app/fresh.py): a typed request as one JSON
line, read back as the same dataclass; anything else is refused in one line."""

import pytest

from gradaccum.app import fresh


@pytest.mark.parametrize(
    "request_",
    [
        fresh.Measure(recipe="digits", precision="bf16", seed=3, meter="rss", windows=3),
        fresh.Measure(hf_model="/models/tiny", lora={"r": 4, "alpha": 8}),
        fresh.PlanRun(config={"recipe": "gpt", "budget": "200MB"}, sequences="/tmp/s.pt"),
    ],
)
def test_a_request_reads_back_as_the_dataclass_it_was(request_):
    line = fresh.encode(request_)
    assert "\n" not in line
    assert fresh.read_request(line + "\n") == request_


def test_a_size_reads_back_and_a_line_that_is_no_request_is_refused():
    size = fresh.Size(micro_size=12, micro_batches=2, checkpointing=True, sample="/tmp/b.pt")
    assert fresh.read_size(fresh.encode(size)) == size
    for line in ('{"kind": "train"}', '{"micro": 3}', "not json", '{"kind": "measure", "x": 1}'):
        with pytest.raises(ValueError, match="not a fresh-process request"):
            fresh.read_request(line)


def test_the_child_says_its_lines_and_its_answer_as_json(capsys):
    import json

    fresh.say("planning the micro-batch")
    fresh.answer({"micro_size": 8})
    fresh.answer(error="budget 1MB is too small")
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == [
        {"log": "planning the micro-batch"},
        {"answer": {"micro_size": 8}},
        {"error": "budget 1MB is too small"},
    ]
