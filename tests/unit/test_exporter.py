"""gradaccum.app.exporter: the run's exports and the whole model gathered from shards, on a
real digits run (a built-in recipe exports no formats) and a kind that holds shards."""

from types import SimpleNamespace

import torch
from support.runs import digits_run, quiet

from gradaccum.app.boundary import Boundary
from gradaccum.app.exporter import Exporter
from gradaccum.app.folder import MODEL


def test_a_built_in_recipe_exports_nothing_and_a_whole_model_writes_no_model_pt(tmp_path):
    run = digits_run(tmp_path / "run")
    try:
        ex = Exporter(run.cfg, run.folder, run.model, run.kind, quiet, str)
        assert not any(ex.due(Boundary(s, end=s == 6, limit=False)) for s in range(1, 7))
        ex.run(Boundary(6, end=True, limit=False))
        assert not (run.folder.path / MODEL).exists()
    finally:
        run.folder.release()


def test_shards_are_gathered_at_the_end_into_model_pt_by_the_writing_rank(tmp_path):
    run = digits_run(tmp_path / "run")
    said = []
    whole = {k: v.clone() for k, v in run.model.state_dict().items()}
    sharded = SimpleNamespace(gathers=True, main=True, gather=lambda model: whole)
    try:
        ex = Exporter(run.cfg, run.folder, run.model, sharded, said.append, str)
        assert not ex.due(Boundary(3, end=False, limit=False))
        assert ex.due(Boundary(6, end=True, limit=False)) and ex.due(
            Boundary(4, end=False, limit=False, hit="max_time")
        )
        ex.run(Boundary(6, end=True, limit=False))
        saved = torch.load(run.folder.path / MODEL, weights_only=True)
        assert saved.keys() == whole.keys()
        assert all(torch.equal(saved[k], whole[k]) for k in whole)
        assert said == [
            f"wrote {run.folder.path / MODEL}: the whole model, gathered from the shards"
        ]
        other = SimpleNamespace(gathers=True, main=False, gather=lambda model: whole)
        (run.folder.path / MODEL).unlink()
        Exporter(run.cfg, run.folder, run.model, other, quiet, str).run(
            Boundary(6, end=True, limit=False)
        )
        assert not (run.folder.path / MODEL).exists()  # another rank gathers, writes nothing
    finally:
        run.folder.release()
