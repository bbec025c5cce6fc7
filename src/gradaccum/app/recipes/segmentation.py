"""Segmentation at high resolution: a small U-Net on procedural 256x256 images.

Each image is a textured background with one to four shapes on it, and its mask marks the
shapes exactly, so nothing is downloaded and the labels are never wrong. Colours are drawn
from one distribution for shapes and background alike; what tells them apart is texture
(fine stripes on a shape, slow waves behind it) under per-pixel noise, so the network has
to learn it and the held-out IoU starts low.

Full-resolution activations make one image cost a lot of memory for backward, so a modest
budget holds only a couple of images per micro-batch: the case accumulation is for. With
GroupNorm every image is normalized on its own and the accumulated step is the large
batch's, exactly. ``norm="batch"`` builds the same network with BatchNorm, which normalizes
each micro-batch with its own statistics: accumulation then changes the model, and
``gradaccum.convert_batchnorm`` makes it exact again.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.loss import sample_mean

if TYPE_CHECKING:
    from gradaccum.app.recipes.base import Recipe

__all__ = [
    "DEFAULTS",
    "SIZE",
    "SegmentationData",
    "UNet",
    "make_image",
    "segmentation_loss",
    "segmentation_recipe",
]

SIZE = 256  # image side in pixels
NORMS = ("group", "batch")
_UNET = {"width": 8, "depth": 4}
HELD_OUT = 32  # held-out images, fixed whatever the seed

# What `gradaccum train --recipe segment` (and segment-batchnorm) wants when a flag is not
# given. The budget is the point of the recipe: the planner fits 2 images per micro-batch
# in it, not 3, so an effective batch of 32 is 16 micro-batches. Its usable part sits
# between the whole run's peaks at the two sizes as the planner's fresh process measures
# them (training after an evaluation included; bench/results/planner.md).
DEFAULTS = {
    "effective_batch": 32,
    "budget": "380MB",
    "steps": 60,
    "lr": 3e-3,
    "warmup_steps": 5,
    "eval_every": 20,
    "checkpoint_every": 20,
}


# -- procedural images with exact masks ---------------------------------------------------------


def _generator(*key: object) -> torch.Generator:
    # A hash of the whole key, not seed * K + index: no two (seed, index) pairs, and no
    # training and held-out image, can share a generator.
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _uniform(g: torch.Generator, low: float, high: float, n: int = 1) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=g)


def _waves(g: torch.Generator, xs: torch.Tensor, ys: torch.Tensor, period: tuple[float, float]):
    """A plane wave in [0, 1]: random orientation, period (pixels) and phase."""
    angle, length, phase = (
        _uniform(g, 0, math.pi),
        _uniform(g, *period),
        _uniform(g, 0, 2 * math.pi),
    )
    along = xs * torch.cos(angle) + ys * torch.sin(angle)
    return 0.5 + 0.5 * torch.sin(2 * math.pi * along / length + phase)


def _paint(g: torch.Generator, t: torch.Tensor) -> torch.Tensor:
    """[3, H, W]: two random colours mixed by ``t``."""
    a, b = torch.rand(3, 1, 1, generator=g), torch.rand(3, 1, 1, generator=g)
    return a + (b - a) * t


def _shape(g: torch.Generator, xs: torch.Tensor, ys: torch.Tensor, size: int) -> torch.Tensor:
    """A boolean [H, W]: a rotated ellipse, rectangle or triangle of random size."""
    kind = int(torch.randint(3, (1,), generator=g))
    cx, cy = _uniform(g, 0.15 * size, 0.85 * size, 2)
    a, b = _uniform(g, 0.07 * size, 0.2 * size, 2)
    angle = _uniform(g, 0, math.pi)
    u = (xs - cx) * torch.cos(angle) + (ys - cy) * torch.sin(angle)
    v = (ys - cy) * torch.cos(angle) - (xs - cx) * torch.sin(angle)
    if kind == 0:
        return (u / a) ** 2 + (v / b) ** 2 <= 1
    if kind == 1:
        return (u.abs() <= a) & (v.abs() <= b)
    # a triangle: inside when on the same side of its three edges (corners counter-clockwise)
    corners = angle + torch.tensor([0.0, 2.1, 4.2]) + _uniform(g, -0.3, 0.3, 3)
    px, py = cx + a * 1.3 * torch.cos(corners), cy + a * 1.3 * torch.sin(corners)
    inside = torch.ones_like(xs, dtype=torch.bool)
    for i in range(3):
        j = (i + 1) % 3
        inside &= (px[j] - px[i]) * (ys - py[i]) - (py[j] - py[i]) * (xs - px[i]) >= 0
    return inside


def make_image(
    seed: int, index: int, size: int = SIZE, *, held_out: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image ``index`` of the stream ``seed``: ``(image float32 [3, size, size] in [0, 1],
    mask int64 [size, size], 1 on the shapes)``, a pure function of its arguments.
    ``held_out``: the held-out stream, disjoint from every training stream."""
    for value, name in ((seed, "seed"), (index, "index")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise ValueError(f"size must be an integer >= 16 (pixels), got {size!r}")
    g = _generator("held-out" if held_out else "train", seed, index)
    ys, xs = torch.meshgrid(
        torch.arange(size, dtype=torch.float32),
        torch.arange(size, dtype=torch.float32),
        indexing="ij",
    )
    # Background: two slow waves; shapes: fine stripes. Periods scale with the image.
    slow = (
        _waves(g, xs, ys, (0.2 * size, 0.6 * size)) + _waves(g, xs, ys, (0.2 * size, 0.6 * size))
    ) / 2
    image = _paint(g, slow)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
        inside = _shape(g, xs, ys, size)
        stripes = _waves(g, xs, ys, (0.016 * size, 0.04 * size))
        image = torch.where(inside, _paint(g, stripes), image)
        mask |= inside
    noise = _uniform(g, 0.03, 0.15) * torch.randn(3, size, size, generator=g)
    return (image + noise).clamp_(0, 1), mask.long()


def _stack(
    seed: int, indices: range, size: int, held_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    images, masks = zip(
        *(make_image(seed, i, size, held_out=held_out) for i in indices), strict=True
    )
    return torch.stack(images), torch.stack(masks)


class SegmentationData:
    """An endless stream of procedural images (sample ``i`` a pure function of ``(seed,
    i)``, so there are no epochs) and a fixed held-out set drawn from its own stream."""

    def __init__(self, seed: int, size: int = SIZE, held_out: int = HELD_OUT) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed, self.size, self.held_out = seed, size, held_out

    def batch(self, position: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _stack(self.seed, range(position, position + size), self.size, held_out=False)

    def epoch_samples(self) -> int:
        return 2048  # nominal: the stream never repeats; --epochs reads this many per pass

    def held_out_batch(self, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out images ``start`` to ``start + size``, made when needed: the set is not
        kept (32 full-resolution images would be 42 MB of resident memory the planner's
        budget does not count)."""
        return _stack(0, range(start, min(start + size, self.held_out)), self.size, held_out=True)

    @property
    def held_out_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.held_out_batch(0, self.held_out)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, micro_size: int, limit: int | None = None
    ) -> dict[str, float]:
        """Pixel-mean cross-entropy and foreground IoU (intersection over union of all
        held-out pixels together), in eval mode."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        loss, pixels, intersection, union = 0.0, 0, 0, 0
        try:
            count = self.held_out if limit is None else min(limit, self.held_out)
            for start in range(0, count, micro_size):
                x, y = self.held_out_batch(start, min(micro_size, count - start))
                x, y = x.to(device), y.to(device)
                logits = model(x)
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
                pixels += y.numel()
                predicted, truth = logits.argmax(1) == 1, y == 1
                intersection += int((predicted & truth).sum())
                union += int((predicted | truth).sum())
        finally:
            model.train(was_training)
        return {"loss": loss / pixels, "iou": intersection / union if union else 1.0}


# -- the model -----------------------------------------------------------------------------------


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(math.gcd(channels // 2, 8), channels)


class ConvBlock(nn.Module):
    """(3x3 conv, norm, ReLU) twice at one resolution."""

    def __init__(self, c_in: int, c_out: int, norm: str) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            _norm(norm, c_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            _norm(norm, c_out),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class UNet(nn.Module):
    """Encoder halving the resolution ``depth`` times (max-pool) while doubling the channels
    from ``width``; decoder upsampling (bilinear) and joining the encoder's features at each
    resolution; two output classes per pixel. Small in parameters, large in activations:
    the full-resolution layers dominate what backward must keep."""

    def __init__(
        self, norm: str = "group", width: int = _UNET["width"], depth: int = _UNET["depth"]
    ):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList(
            ConvBlock(c_in, c_out, norm) for c_in, c_out in zip([3, *widths], widths, strict=False)
        )
        self.up = nn.ModuleList(
            ConvBlock(widths[i + 1] + widths[i], widths[i], norm) for i in reversed(range(depth))
        )
        self.head = nn.Conv2d(width, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(F.max_pool2d(x, 2) if i else x)
            skips.append(x)
        skips.pop()  # the bottom is x itself
        for block in self.up:
            skip = skips.pop()
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skip], dim=1))
        return self.head(x)


def segmentation_loss(
    model: nn.Module, micro_batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """Each image's mean pixel cross-entropy, summed over the micro-batch; count = images.
    Images are equal in size, so this is also the pixel mean over the whole batch."""
    images, masks = micro_batch
    return sample_mean(F.cross_entropy(model(images), masks, reduction="none"))


def segmentation_recipe(norm: str = "group") -> Recipe:
    """The ``segment`` recipe with GroupNorm (exact under accumulation) or BatchNorm."""
    from gradaccum.app.recipes.base import Recipe

    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
    name = "GroupNorm" if norm == "group" else "BatchNorm"
    return Recipe(
        name="segment" if norm == "group" else "segment-batchnorm",
        summary=f"U-Net ({name}) segmenting procedural {SIZE}x{SIZE} shapes by texture",
        item="image",
        build_model=functools.partial(UNet, norm),
        loss_fn=segmentation_loss,
        sample_batch=lambda n: (
            torch.zeros(n, 3, SIZE, SIZE),
            torch.zeros(n, SIZE, SIZE, dtype=torch.long),
        ),
        make_data=SegmentationData,
        signature={"recipe": "segment", "norm": norm, "size": SIZE, **_UNET},
        metrics=("loss", "iou"),
        defaults=DEFAULTS,
    )
