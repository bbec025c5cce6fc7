"""FSDP2 checkpoints: each rank's shards through torch.distributed.checkpoint, read back
without unpickling anything but DCP's metadata types (2 gloo processes on 127.0.0.1)."""

from __future__ import annotations

import pickle

import pytest
import torch
import workers
from launch import launch

from gradaccum.checkpoint import safe_reader


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    launch(workers.sharded_resume, str(out))
    return out, torch.load(out / "sharded.pt", weights_only=False)


def test_a_sharded_checkpoint_resumes_bitwise_and_rolls_back_to_an_empty_optimizer(sharded):
    _, got = sharded
    names = got["straight"].keys()
    assert all(torch.equal(got["resumed"][n], got["straight"][n]) for n in names)
    assert got["state"].optimizer_steps == 4 and got["state"].windows == 4
    # Step 0's checkpoint holds no optimizer state: restoring it empties the optimizer, and
    # the 4 steps replayed from there are the first 4 steps again, bit for bit.
    assert got["empty"]
    assert all(torch.equal(got["replayed"][n], got["straight"][n]) for n in names)
    # each rank its shards, and its own counters and generators
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= set(got["files"])
    assert sum(f.endswith(".distcp") for f in got["files"]) == 2


def test_checkpoint_metadata_that_names_other_code_is_refused(sharded, tmp_path):
    out, _ = sharded
    reader = safe_reader()(out / "step-2")
    metadata = reader.read_metadata()  # the real one reads
    assert "model.head.weight" in metadata.state_dict_metadata

    class Payload:  # what a tampered .metadata could hold: a call made while unpickling
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        safe_reader()(tmp_path).read_metadata()
