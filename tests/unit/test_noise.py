"""The gradient noise scale against its closed form, its interval's coverage, and that it
changes nothing else."""

import math

import pytest
import torch
from helpers import make_model, params
from torch import nn

import gradaccum as ga
from gradaccum.noise import NoiseReading, advice, advise, tradeoff_advice
from gradaccum.stats import fieller, t_quantile


def regression(d: float, s: float, delta_norm: float, seed: int):
    """y = x.w* + eps, x ~ N(0, I_d), eps ~ N(0, s^2), per-sample loss (x.w - y)^2 / 2 at
    w = w* + delta. Per-sample gradient g = x x^T delta - x eps: G = delta and, by Isserlis'
    theorem, tr(Sigma) = (d + 1)|delta|^2 + d s^2, so B_simple = d + 1 + d s^2 / |delta|^2.
    Returns (B_simple, |G|^2, w*, delta)."""
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=g)
    delta = torch.randn(d, generator=g)
    delta = delta / delta.norm() * delta_norm
    return d + 1 + d * s**2 / delta_norm**2, delta_norm**2, w_star, delta


def test_noise_scale_matches_the_closed_form_on_linear_regression():
    d, s = 10, 1.5
    analytic, g2_true, w_star, delta = regression(d, s, 0.8, seed=0)
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    acc = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), noise=ga.NoiseScale())
    # lr 0: the same point, so the estimates can settle

    def loss_fn(model, mb):
        x, y = mb
        return ga.sample_mean(0.5 * (model(x).squeeze(1) - y) ** 2)

    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        x = torch.randn(128, d, generator=g)
        y = x @ w_star + s * torch.randn(128, generator=g)
        result = acc.step(ga.split((x, y), 16), loss_fn)
    print(
        f"B_simple estimated {result.noise_scale:.1f} {result.noise_interval}, "
        f"analytic {analytic:.1f}"
    )
    assert result.noise_scale == pytest.approx(analytic, rel=0.15)
    low, high = result.noise_interval
    assert low < result.noise_scale < high
    assert acc.noise.estimates()[0] == pytest.approx(g2_true, rel=0.15)
    assert acc.noise.reading().windows == 200  # the last half of 400 equal windows


def feed(noise: ga.NoiseScale, d, s, delta_norm, seed, windows, micro=4, n_micro=8):
    """Windows of ``n_micro`` micro-batches of ``micro`` samples straight into the estimator:
    each prefix's squared norm from the per-sample gradients x (x.delta - eps), computed here
    (the same numbers an Accumulator's .grad holds at lr 0, without a model)."""
    truth, _, _, delta = regression(d, s, delta_norm, seed)
    g = torch.Generator().manual_seed(10_000 + seed)
    size = micro * n_micro
    x = torch.randn(windows, size, d, generator=g, dtype=torch.float64)
    eps = s * torch.randn(windows, size, generator=g, dtype=torch.float64)
    per_sample = x * ((x @ delta.double()) - eps)[..., None]
    prefix = per_sample.reshape(windows, n_micro, micro, d).sum(2).cumsum(1)  # summed gradients
    sq = prefix.square().sum(-1)
    for w in range(windows):
        for i in range(n_micro):
            noise.add_prefix(sq[w, i], micro)
        window_mean_sq = float(sq[w, -1]) / size**2
        noise.end_window(window_mean_sq, size)
    return truth


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_the_interval_covers_the_truth_at_its_confidence():
    """The issue's problem: d = 8, micro-batches of 4, windows of 8, B_simple = 12.35. Here 20
    seeds of 600 windows each (the horizon: the last 300); bench/noise.py runs the full
    20 x 3,000 windows through the Accumulator. Measured here: 17 of 20 intervals cover it;
    the median reading is 10% off, the worst 32% (one window's pair scatters by about twice
    its value, and 300 windows leave about 11%: the interval says so)."""
    covered, errors = 0, []
    for seed in range(20):
        noise = ga.NoiseScale()
        truth = feed(noise, 8, 1.0, 1.5453, seed, windows=600)
        reading = noise.reading()
        assert reading.value is not None and reading.confidence == 0.9
        covered += reading.low <= truth <= reading.high
        errors.append(abs(reading.value / truth - 1))
    errors.sort()
    print(f"covered {covered}/20, median error {errors[10]:.1%}, largest {errors[-1]:.1%}")
    assert covered >= 17


def test_no_reading_while_the_gradient_is_not_clearly_positive():
    """At the optimum (delta = 0) the true |G|^2 is 0: whatever the windows say, the
    estimate must not turn into a batch size."""
    noise = ga.NoiseScale()
    feed(noise, 8, 1.0, 1e-9, seed=3, windows=200)
    reading = noise.reading()
    assert reading.value is None and "not clearly positive" in reading.why
    assert "no reading yet" in advice(64, reading) and "not clearly positive" in advice(64, reading)
    fresh = ga.NoiseScale().reading()
    assert fresh.value is None and fresh.windows == 0


@pytest.mark.slow  # seconds: the slow tier keeps make test-fast under a minute
def test_the_horizon_follows_the_items_and_a_long_run_stays_small():
    """Windows of different sizes (a batch-size schedule): the horizon is the last half of
    the items, not of the windows. Beyond 2,048 entries neighbours merge (3,000 windows: one
    merge), and the means stay the plain means of every window in the horizon."""
    noise = ga.NoiseScale(horizon=1.0)
    pairs = []
    for w in range(3000):
        g2, trace = 1.0 + (w % 7) / 10, 30.0 + (w % 5)
        # two prefixes on the line |G_B|^2 = g2 + trace / B (at B = 4 and B = 8)
        noise.add_prefix(torch.tensor((g2 + trace / 4) * 16, dtype=torch.float64), 4)
        noise.add_prefix(torch.tensor((g2 + trace / 8) * 64, dtype=torch.float64), 4)
        noise.end_window((g2 + trace / 8), 8)
        pairs.append((g2, trace))
    assert len(noise._entries) <= 2048
    mean_g2 = sum(p[0] for p in pairs) / len(pairs)
    mean_trace = sum(p[1] for p in pairs) / len(pairs)
    assert noise.estimates() == pytest.approx((mean_g2, mean_trace), rel=1e-9)

    half = ga.NoiseScale()  # the default horizon: half the items
    for size in [8] * 30 + [80] * 3:  # 240 items in 30 windows, then 240 in 3
        for _ in range(size // 4):
            half.add_prefix(torch.tensor(16.0), 4)
        half.end_window(16.0 / size**2 * (size // 4), size)
    assert half.reading().windows == 3  # the last 240 of 480 items are the 3 large windows


def test_state_travels_and_a_resumed_estimate_is_the_same():
    noise = ga.NoiseScale()
    feed(noise, 8, 1.0, 1.5453, seed=0, windows=100)
    again = ga.NoiseScale()
    again.load_state_dict(noise.state_dict())
    assert again.reading() == noise.reading()
    feed(noise, 8, 1.0, 1.5453, seed=1, windows=20)
    feed(again, 8, 1.0, 1.5453, seed=1, windows=20)
    assert again.reading() == noise.reading()


def test_bad_settings_are_refused_with_the_value():
    with pytest.raises(ValueError, match="horizon must be .* got 0"):
        ga.NoiseScale(horizon=0)
    with pytest.raises(ValueError, match="confidence must be .* got 1.5"):
        ga.NoiseScale(confidence=1.5)
    with pytest.raises(ValueError, match="groups must be an integer >= 3, got 2"):
        ga.NoiseScale(groups=2)


def test_t_quantiles_and_fiellers_interval_against_known_values():
    # Student's t at 0.95 (tables): 2.919986 (2), 2.015048 (5), 1.729133 (19)
    for dof, want in ((2, 2.919986), (5, 2.015048), (19, 1.729133)):
        assert t_quantile(0.95, dof) == pytest.approx(want, rel=3e-3)
    # With an exact denominator the interval is the numerator's, divided.
    low, high = fieller(10.0, 2.0, 1.0, 0.0, 0.0, 2.0)
    assert (low, high) == pytest.approx((4.0, 6.0))
    assert fieller(10.0, 1.0, 1.0, 1.0, 0.0, 2.0) is None  # 1 is not clearly above 0


def test_noise_scale_changes_nothing_else_and_is_off_by_default(tmp_path):
    from helpers import TASKS, UNEVEN_SIZES, split_sizes

    factory, make_batch, loss_fn, _ = TASKS["lm"]
    runs = {}
    for on in (False, True):
        model = make_model(factory)
        acc = ga.Accumulator(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            noise=ga.NoiseScale() if on else None,
        )
        results = [
            acc.step(split_sizes(make_batch(seed=i), UNEVEN_SIZES[4]), loss_fn) for i in range(4)
        ]
        runs[on] = (params(model), results, acc)
    assert all(torch.equal(runs[False][0][k], runs[True][0][k]) for k in runs[False][0])
    assert all(r.noise_scale is None and r.noise_interval is None for r in runs[False][1])
    assert runs[False][2].noise is None
    assert runs[True][2].noise.updates == 4
    # and it travels with checkpoints
    torch.save(runs[True][2].state_dict(), tmp_path / "c.pt")
    model = make_model(factory)
    again = ga.Accumulator(model, torch.optim.AdamW(model.parameters()), noise=ga.NoiseScale())
    again.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    assert again.noise.estimates() == runs[True][2].noise.estimates()


def reading(value, low, high, windows=60):
    return NoiseReading(value, low, high, windows, 0.9)


def test_advice_names_a_direction_only_when_the_interval_excludes_the_batch():
    above = advise(800, reading(100.0, 60.0, 200.0))
    assert above.direction == "smaller" and above.batch is None
    assert "a smaller batch would reach the same loss on about " in str(above)
    assert "90% interval 60 to 200, from the last 60 windows" in above.measurement()
    below = advise(10, reading(100.0, 60.0, 200.0))
    assert below.direction == "larger" and "a larger batch" in str(below)
    inside = advise(100, reading(100.0, 60.0, 200.0))
    assert inside.direction is None and "inside B_simple's interval" in str(inside)
    assert "not estimated yet" in advice(800, None)
    waiting = NoiseReading(None, None, None, 2, 0.9, "only 2 windows in its horizon so far")
    assert advice(800, waiting) == (
        "gradient noise scale: no reading yet: only 2 windows in its horizon so far"
    )
    for text in map(str, (above, below, inside)):
        assert not any(w in text for w in ("nan", "inf", "None", "--"))


def test_advice_is_a_measurement_first_and_waits_for_a_narrow_interval_and_a_long_run():
    """A reading over few windows or with a wide interval is said, and no batch named."""
    wide = advise(800, reading(100.0, 20.0, 200.0))  # a factor of 10
    assert wide.direction is None and "spans more than a factor of 4" in wide.why
    short = advise(800, reading(100.0, 60.0, 200.0, windows=20))  # a 20-step run's
    assert short.direction is None and "rests on 20 windows; advice waits for 50" in short.why
    for found in (wide, short):
        lines = str(found).splitlines()
        assert lines[0].startswith("gradient noise scale B_simple ~ 100 items per step")
        assert lines[1].startswith("no advice on the effective batch")


def test_a_smaller_batch_is_advised_with_its_cost_and_named_by_the_caller():
    """28 samples of 4 items against 64: by S = S_min (1 + B_noise / B), the smaller batch
    takes (1 + 112/112) / (1 + 112/256) - 1 = 39% more optimizer steps, said with it."""
    found = advise(256, reading(112.0, 80.0, 160.0), items_per_sample=4.0)
    assert found.direction == "smaller" and found.batch == 28
    more_steps = (1 + 112 / 112) / (1 + 112 / 256) - 1
    said = found.sentence(lambda n: f"--effective-batch {n}")
    print(said)
    assert said.startswith("a smaller batch (--effective-batch 28, about B_simple) would")
    fewer_samples = 1 - (1 + 112 / 112) / (1 + 256 / 112)  # E = E_min (1 + B / B_noise)
    # each figure said once, with what it counts, and the loss they reach named once
    assert f"the same loss on about {fewer_samples:.0%} (" in said
    assert f"fewer samples, in about {more_steps:.0%} (" in said
    assert said.count("same loss") == 1 and said.count("%") == 6
    assert said.count("fewer samples") == 1 and said.count("more optimizer steps") == 1
    assert "learning rate was set for" in said
    # the library's own words name no flag
    assert "an effective batch of 28 samples" in found.sentence() and "--" not in str(found)
    larger = advise(16, reading(112.0, 80.0, 160.0), items_per_sample=4.0)
    fewer_steps = 1 - (1 + 112 / 112) / (1 + 112 / 16)
    more_samples = (1 + 112 / 112) / (1 + 16 / 112) - 1  # 28 samples of 4 items against 16
    assert larger.direction == "larger"
    assert f"the same loss in about {fewer_steps:.0%} (" in str(larger)
    assert f"fewer optimizer steps, on about {more_samples:.0%} (" in str(larger)
    assert str(larger).count("same loss") == 1


@pytest.mark.parametrize(
    ("value", "low", "high", "batch", "reference"),
    [
        (3861.0, 2458.0, 5996.0, 8128.0, 127.0),  # the demo's reading, in bytes
        (35.0, 20.0, 60.0, 64.0, 1.0),  # a batch near B_simple
        (100.0, 60.0, 200.0, 10.0, 2.0),  # a batch far below it
        (100.0, 0.0, 5000.0, 800.0, 4.0),  # an interval that reaches 0: too uncertain
        (5.0, 4.0, 6.0, 1e6, 1.0),  # far above: nearly all the samples extra
    ],
)
def test_the_tradeoff_follows_mccandlish_formula_with_the_interval_carried(
    value, low, high, batch, reference
):
    """Steps S(B) = S_min (1 + B_noise / B), samples E(B) = E_min (1 + B / B_noise), written out
    here: the batch against the reference batch, at B_simple and at the interval's ends."""

    def more_samples(noise):
        return (1 + batch / noise) / (1 + reference / noise) - 1 if noise else batch / reference - 1

    def fewer_steps(noise):
        return 1 - (1 + noise / batch) / (1 + noise / reference)

    found = reading(value, low, high).tradeoff(batch, reference)
    assert found.more_samples[0] == pytest.approx(more_samples(value))
    assert found.fewer_steps[0] == pytest.approx(fewer_steps(value))
    # a larger B_simple: fewer extra samples, more steps saved
    assert found.more_samples[1] == pytest.approx(more_samples(high))
    assert found.more_samples[2] == pytest.approx(more_samples(low))
    assert found.fewer_steps[1] == pytest.approx(fewer_steps(low))
    assert found.fewer_steps[2] == pytest.approx(fewer_steps(high))
    for lo, _, hi in (sorted(found.more_samples), sorted(found.fewer_steps)):
        assert math.isfinite(lo) and math.isfinite(hi) and lo >= 0
    assert found.more_samples[1] <= found.more_samples[0] <= found.more_samples[2]
    assert 0 <= found.fewer_steps[1] <= found.fewer_steps[0] <= found.fewer_steps[2] < 1
    assert found.certain == (low > 0 and high <= 4 * low)
    text = found.sentence("a batch of one sample")
    assert not any(w in text for w in ("nan", "inf", "None", "-"))
    if found.certain:
        assert f"{found.more_samples[0]:.0%} ({found.more_samples[1]:.0%} to" in text
    else:
        assert "too uncertain yet" in text


def test_no_tradeoff_without_a_reading_or_a_larger_batch():
    assert reading(100.0, 60.0, 200.0).tradeoff(4.0, 4.0) is None
    assert NoiseReading(None, None, None, 2, 0.9, "too few").tradeoff(64.0) is None
    assert tradeoff_advice(64, None) is None
    said = tradeoff_advice(64, reading(35.0, 20.0, 60.0), items_per_sample=None)
    assert said.startswith("against a batch of one item, this batch should take about")
