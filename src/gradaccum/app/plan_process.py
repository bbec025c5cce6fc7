"""``python -m gradaccum.app.plan_process``: a run's plan made in a process of its own, for
``gradaccum train`` (``planning._plan_elsewhere``). Not a command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from gradaccum.app.build import build_model, build_optimizer, run_data
from gradaccum.app.config import TrainConfig
from gradaccum.app.measure import FreshProcessVerifier
from gradaccum.app.planning import as_flags, verifier, window_plan
from gradaccum.app.process import exit_with_parent, quiet_third_parties
from gradaccum.app.recipes import get_recipe, hf_recipe


def main(argv: list[str] | None = None) -> int:
    """``python -m gradaccum.app.plan_process CONFIG OUT [--sequences FILE]``: the plan of a
    run's configuration (config.json's form), as ``gradaccum train`` makes it, written to OUT
    as {"info": plan} or {"error": one line}. Not a command: ``_plan_elsewhere`` runs it."""
    quiet_third_parties()  # its output is the run's log
    ap = argparse.ArgumentParser(prog="python -m gradaccum.app.plan_process")
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--sequences", default=None)
    ap.add_argument("--parent-pipe", type=int, default=None)
    a = ap.parse_args(argv)
    if a.parent_pipe is not None:
        exit_with_parent(a.parent_pipe)

    def log(message: str) -> None:
        print(message, flush=True)

    cfg = TrainConfig.of(**json.loads(Path(a.config).read_text()))
    # the fresh process that verifies the plan imports and builds while this one does
    with verifier(cfg) as started:
        return _plan(cfg, a, log, started)


def _plan(cfg: TrainConfig, a: argparse.Namespace, log, started: FreshProcessVerifier) -> int:
    src = cfg.source
    try:
        recipe = hf_recipe(src.hf_model) if src.hf_model else get_recipe(src.recipe)
        loaded = None if a.sequences is None else torch.load(a.sequences, weights_only=True)
        model = build_model(cfg, recipe, lambda _: None)  # (the run logs its LoRA line)
        recipe, data = run_data(cfg, recipe, loaded)
        optimizer = build_optimizer(cfg, model)
        device = torch.device("cpu")
        info = window_plan(
            cfg, model, optimizer, recipe, device, 0, 1, log, each_rank=False, data=data,
            here=True, started=started,
        )  # fmt: skip
    except ValueError as err:
        Path(a.out).write_text(json.dumps({"error": as_flags(str(err))}))
        return 2
    Path(a.out).write_text(json.dumps({"info": info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
