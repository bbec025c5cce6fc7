"""Peak memory and seconds per optimizer step vs N for the segmentation recipe, its plan,
and its exactness.

The U-Net (GroupNorm) on 256x256 images at an effective batch of 32, as N micro-batches of
32 / N for N = 1, 2, 4, 8, 16, each N in a fresh process (``vs_n``: how it is measured);
the plan at the recipe's default budget, verified in two fresh processes as ``gradaccum
train`` verifies it on CPU; and the gradient of one window (16 micro-batches of 2) against
the full batch of 32 at the recipe's 256x256, in float64 (fp32's own rounding of the full
batch is measured beside it): GroupNorm, BatchNorm, and BatchNorm after
``convert_batchnorm``.

Writes bench/results/segmentation.md and bench/results/segmentation.png.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import vs_n

import gradaccum as ga
from gradaccum.app.recipes.segmentation import (
    DEFAULTS,
    SIZE,
    SegmentationData,
    segmentation_loss,
    segmentation_recipe,
)

EFFECTIVE = DEFAULTS["effective_batch"]


def exactness() -> dict[str, float]:
    """Largest relative error over the parameters between one window's gradient (16 x 2,
    through the Accumulator) and the full batch of 32's (plain autograd on the mean pixel
    loss), float64, 256x256, for each normalization."""
    import torch.nn.functional as F

    torch.set_num_threads(vs_n.threads())
    images, masks = SegmentationData(0).batch(0, EFFECTIVE)
    batch = (images.double(), masks)
    out = {}
    for name in ("GroupNorm", "BatchNorm", "BatchNorm after convert_batchnorm"):
        grads = []
        for accumulate in (False, True):
            torch.manual_seed(0)
            model = segmentation_recipe("group" if name == "GroupNorm" else "batch").build_model()
            if "convert" in name:
                ga.convert_batchnorm(model)
            model.double()
            if accumulate:
                grads.append(vs_n.window_gradients(model, batch, 2, segmentation_loss))
            else:
                F.cross_entropy(model(batch[0]), batch[1]).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        out[name] = vs_n.worst_tensor(grads[1], grads[0])
        if name == "GroupNorm":  # fp32's own rounding of the same full batch, for scale
            torch.manual_seed(0)
            model = segmentation_recipe("group").build_model()
            F.cross_entropy(model(images), masks).backward()
            fp32 = {n: p.grad.double() for n, p in model.named_parameters()}
            out["GroupNorm, the full batch in fp32 (not a window)"] = vs_n.worst_tensor(
                fp32, grads[0]
            )
    return out


def main() -> None:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    rows = vs_n.rows_for(__file__)
    plan = vs_n.planned("segment")
    print(plan.summary(), flush=True)
    exact = vs_n.fresh(__file__, "--exact")
    print(exact, flush=True)
    load_after = os.getloadavg()[0]
    by_n = {r["n"]: r for r in rows}
    slowdown = by_n[16]["fastest"] / by_n[1]["fastest"]
    saved = by_n[1]["peak"] / by_n[16]["peak"]
    lines = [
        "# Segmentation: peak memory and time per step vs N",
        "",
        f"Recipe `segment` (U-Net, GroupNorm, {SIZE}x{SIZE} procedural images), effective batch "
        f"{EFFECTIVE}, AdamW, fp32; " + vs_n.how(load_before, load_after),
        "",
        *vs_n.table(rows),
        "",
        vs_n.budget_text(rows, DEFAULTS["budget"]) + " Sixteen micro-batches of 2 "
        f"take {saved:.1f}x less memory than one batch of {EFFECTIVE} and {slowdown:.2f}x its "
        "time per step (fastest windows), for the same gradient.",
        "",
        *vs_n.plan_lines(plan),
        "",
        f"One window of 16 micro-batches of 2 against the full batch of {EFFECTIVE}, at "
        f"{SIZE}x{SIZE} in float64 (largest relative error over the parameters: the norm of "
        "the difference over the norm of the full batch's gradient). The recipe trains in "
        "fp32, whose own rounding of the full batch (last row) is far above 1e-6 at this "
        "size, so exactness is shown where the arithmetic can show it:",
        "",
        "| model | against the full batch in float64 |",
        "|---|---:|",
        *[f"| {name} | {err:.1e} |" for name, err in exact.items()],
    ]
    vs_n.write("segmentation", lines, rows, EFFECTIVE, DEFAULTS["budget"], started)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(vs_n.measure("segment", EFFECTIVE, int(sys.argv[2]), lr=1e-3)))
    elif sys.argv[1:2] == ["--exact"]:
        print(json.dumps(exactness()))
    else:
        main()
