"""PipelineWindow's refusals (its exactness runs in 2 processes: tests/integration/distributed/
test_pipeline_parallel.py)."""

import pytest
import torch

from gradaccum.pipeline import PipelineWindow


def optimizer():
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 4, "schedule": "zero-bubble"}, "schedule must be one of gpipe, 1f1b"),
        ({"micro_batches": 0}, "micro_batches must be a positive integer, got 0"),
        ({"micro_batches": 2.5}, "micro_batches must be a positive integer, got 2.5"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineWindow(None, optimizer(), lambda out, y: (out.sum(), 1), **kwargs)
