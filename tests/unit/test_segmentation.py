"""The segmentation recipe: its procedural data, its held-out metrics, and the U-Net's
accumulated step against the full batch (exact with GroupNorm; not with BatchNorm until
``convert_batchnorm``).

Most tests use 64x64 images, the gradient comparisons 32x32, instead of the recipe's
256x256: purity in (seed, index), the metrics' arithmetic and the exactness of a window do
not depend on the image size, and small windows of 32 images take a second, not several
seconds each (more in float64, below)."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import capture_step_grads, make_model, max_rel_err, reference_grads
from torch import nn

import gradaccum as ga
from gradaccum.app.recipes import get_recipe
from gradaccum.app.recipes.segmentation import (
    DEFAULTS,
    SIZE,
    SegmentationData,
    UNet,
    make_image,
    segmentation_loss,
    segmentation_recipe,
)
from gradaccum.diagnose import batchnorm_modules

SMALL = 64
TINY = 32  # the gradient comparisons': float64 convolutions are slow on CPU
GRAD_TOL = 1e-6
EFFECTIVE, MICRO = 32, 2  # the recipe's default window: 16 micro-batches of 2


def full_batch_mean(model, batch):
    """The reference: plain PyTorch, the mean pixel loss over the whole batch."""
    images, masks = batch
    return F.cross_entropy(model(images), masks)


def window_grads(model, batch, micro):
    """The gradient an Accumulator hands the optimizer for one window of ``batch``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = capture_step_grads(optimizer, model)
    result = ga.Accumulator(model, optimizer).step(ga.split(batch, micro), segmentation_loss)
    assert result.stepped and result.micro_batches == EFFECTIVE // micro
    return seen[0]


# -- data -----------------------------------------------------------------------------------------


def test_samples_are_a_pure_function_of_seed_and_index():
    data = SegmentationData(3, size=SMALL)
    whole = data.batch(0, 4)
    cut = [data.batch(0, 2), data.batch(2, 2)]
    for i in range(2):
        assert torch.equal(whole[i], torch.cat([c[i] for c in cut]))
    again = SegmentationData(3, size=SMALL).batch(1, 2)
    assert torch.equal(again[0], whole[0][1:3]) and torch.equal(again[1], whole[1][1:3])
    image, mask = make_image(3, 2, SMALL)
    assert torch.equal(image, whole[0][2]) and torch.equal(mask, whole[1][2])
    other = SegmentationData(4, size=SMALL).batch(0, 4)
    assert not torch.equal(other[0], whole[0])


def test_images_and_masks_have_the_recipe_shapes_and_values():
    image, mask = make_image(0, 0)
    assert image.shape == (3, SIZE, SIZE) and image.dtype == torch.float32
    assert mask.shape == (SIZE, SIZE) and mask.dtype == torch.int64
    images, masks = SegmentationData(0, size=SMALL).batch(0, 32)
    assert images.min() >= 0 and images.max() <= 1
    assert set(masks.unique().tolist()) == {0, 1}
    fractions = masks.float().mean(dim=(1, 2))
    print(f"foreground fraction per image: {fractions.min():.3f} to {fractions.max():.3f}")
    assert fractions.min() > 0.005 and fractions.max() < 0.6  # never empty, never all shape
    assert 0.05 < fractions.mean() < 0.4


def test_texture_not_colour_tells_shapes_from_background():
    """Colour alone does not separate the classes: the mean colours of the two classes are
    close over many images (the network has to learn texture)."""
    images, masks = SegmentationData(0, size=SMALL).batch(0, 64)
    fg = images.permute(1, 0, 2, 3)[:, masks == 1].mean(dim=1)
    bg = images.permute(1, 0, 2, 3)[:, masks == 0].mean(dim=1)
    assert (fg - bg).abs().max() < 0.1, (fg, bg)


def test_held_out_images_are_not_training_images():
    data = SegmentationData(0, size=SMALL, held_out=8)
    held_images, held_masks = data.held_out_set
    assert held_images.shape == (8, 3, SMALL, SMALL)
    assert torch.equal(held_images, SegmentationData(5, size=SMALL, held_out=8).held_out_set[0])
    train_images, _ = data.batch(0, 64)
    for image in held_images:
        assert not any(torch.equal(image, t) for t in train_images)


@pytest.mark.parametrize(
    "args",
    [(-1, 0), (0, -2), (0, 1.5), (True, 0)],
)
def test_make_image_refuses_what_is_not_a_non_negative_integer(args):
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        make_image(*args, SMALL)


# -- loss and metrics -----------------------------------------------------------------------------


def test_loss_is_the_per_image_pixel_mean_summed():
    torch.manual_seed(0)
    model = UNet(width=4, depth=2)
    batch = SegmentationData(0, size=SMALL).batch(0, 3)
    loss_sum, count = segmentation_loss(model, batch)
    assert count == 3
    with torch.no_grad():
        expected = sum(
            float(F.cross_entropy(model(x[None]), y[None])) for x, y in zip(*batch, strict=True)
        )
    assert loss_sum.item() == pytest.approx(expected, rel=1e-5)


class Constant(nn.Module):
    """Logits (0, 1) at every pixel: everything predicted foreground."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(x.shape[0], 2, *x.shape[2:])
        logits[:, 1] = 1
        return logits * self.scale


def test_evaluate_reports_loss_and_iou_and_keeps_train_mode():
    data = SegmentationData(0, size=SMALL, held_out=6)
    _, masks = data.held_out_set
    model = Constant().train()
    metrics = data.evaluate(model, micro_size=4)  # micro-batches of 4 and 2
    assert model.training
    fg = float(masks.float().mean())
    # everything foreground: IoU = foreground pixels / all pixels; CE of logits (0, 1)
    assert metrics["iou"] == pytest.approx(fg, rel=1e-9)
    expected = fg * math.log1p(math.exp(-1)) + (1 - fg) * math.log1p(math.exp(1))
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)

    torch.manual_seed(0)
    unet = UNet(width=4, depth=2).eval()
    metrics = data.evaluate(unet, micro_size=4)
    assert not unet.training  # restored to what it was
    assert metrics.keys() == {"loss", "iou"}
    assert 0 <= metrics["iou"] <= 1 and metrics["loss"] > 0


# -- exactness under accumulation -----------------------------------------------------------------
# In float64. In float32 the full batch's own gradient is off from the float64 one by about
# 1e-5 (relative; more at 256x256): each conv weight's gradient is a sum over every pixel of
# every image, with much cancellation. A 1e-6 tolerance cannot tell an exact window from an
# inexact one below that floor; in float64 the floor is about 1e-14.


def float64(batch):
    images, masks = batch
    return images.double(), masks


def test_groupnorm_window_equals_the_full_batch():
    batch = float64(SegmentationData(0, size=TINY).batch(0, EFFECTIVE))
    expected = reference_grads(make_model(UNet).double(), batch, full_batch_mean)
    got = window_grads(make_model(UNet).double(), batch, MICRO)
    err = max_rel_err(got, expected)
    print(f"GroupNorm U-Net, 16 x 2 vs 32 (float64): gradient relative error {err:.2e}")
    assert err <= GRAD_TOL


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_groupnorm_window_in_float32_is_as_accurate_as_the_full_batch():
    """At the recipe's precision, judged against the float64 gradient: the window's error
    is no larger than the float32 full batch's own (summing in smaller pieces tends to be
    more accurate, not less)."""
    batch = SegmentationData(0, size=TINY).batch(0, EFFECTIVE)
    truth = reference_grads(make_model(UNet).double(), float64(batch), full_batch_mean)
    full = max_rel_err(reference_grads(make_model(UNet), batch, full_batch_mean), truth)
    window = max_rel_err(window_grads(make_model(UNet), batch, MICRO), truth)
    print(f"float32 vs float64: window {window:.2e}, full batch {full:.2e}")
    assert 0 < full < 2e-3 and window <= 2 * full  # measured: both 5.2e-4


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_batchnorm_window_differs_and_converted_model_is_exact():
    batch = float64(SegmentationData(0, size=TINY).batch(0, EFFECTIVE))

    def bn_unet():
        return UNet(norm="batch").double()

    expected = reference_grads(make_model(bn_unet), batch, full_batch_mean)
    got = window_grads(make_model(bn_unet), batch, MICRO)
    err = max_rel_err(got, expected)
    print(f"BatchNorm U-Net, 16 x 2 vs 32: gradient relative error {err:.2e}")
    assert err > 1e-3  # each micro-batch of 2 is normalized with its own statistics

    def converted():
        model = bn_unet()
        assert len(ga.convert_batchnorm(model)) == len(batchnorm_modules(bn_unet()))
        assert not batchnorm_modules(model)
        return model

    expected = reference_grads(make_model(converted), batch, full_batch_mean)
    got = window_grads(make_model(converted), batch, MICRO)
    err = max_rel_err(got, expected)
    print(f"after convert_batchnorm, 16 x 2 vs 32: gradient relative error {err:.2e}")
    assert err <= GRAD_TOL


# -- the recipe -----------------------------------------------------------------------------------


def test_recipe_describes_the_task():
    recipe = segmentation_recipe()
    assert recipe.name == "segment" and recipe.metrics == ("loss", "iou")
    images, masks = recipe.sample_batch(2)
    assert images.shape == (2, 3, SIZE, SIZE) and masks.shape == (2, SIZE, SIZE)
    assert recipe.signature["norm"] == "group"
    assert not batchnorm_modules(recipe.build_model())
    assert get_recipe("segment").signature == recipe.signature
    assert recipe.defaults == DEFAULTS
    batch_recipe = get_recipe("segment-batchnorm")
    assert batch_recipe.name == "segment-batchnorm"
    assert batch_recipe.signature != recipe.signature
    assert batchnorm_modules(batch_recipe.build_model())
    assert DEFAULTS["effective_batch"] == EFFECTIVE
    with pytest.raises(ValueError, match="norm must be one of group, batch, got 'layer'"):
        segmentation_recipe("layer")
    with pytest.raises(ValueError, match="norm must be one of"):
        UNet(norm="instance")
