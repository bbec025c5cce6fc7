"""The window's arithmetic (gradaccum.window): the end against torch's own clip_grad_norm_,
and one tally behind the Accumulator, the framework window and the pipeline window."""

import math

import pytest
import torch
from helpers import (
    TinyLM,
    capture_step_grads,
    lm_reference,
    make_model,
    max_rel_err,
    padded_lm_batch,
    reference_grads,
    split_sizes,
)

import gradaccum as ga
from gradaccum.window import SkipPolicy, finish, total_norm


def gradients(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(5, 3, generator=g),
        torch.randn(7, generator=g),
        torch.randn(1, generator=g),
    ]


def test_one_division_then_torch_clipping_rule():
    divisor = 12.0
    for max_norm in (None, 1e9, 0.05):
        grads = gradients()
        # torch alone: divide, measure, clip (clip_grad_norm_ on parameters holding the mean)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g / divisor
        expected_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf))
        grad_norm, finite = finish(grads, divisor, max_norm)
        assert finite
        assert grad_norm == pytest.approx(expected_norm, rel=1e-6)
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0)
    assert float(total_norm(grads)) < 0.05 * 1.0001  # clipped to the limit


def test_a_non_finite_gradient_is_reported_and_left_alone():
    grads = gradients()
    grads[1][3] = float("nan")
    before = [g.clone() for g in grads]
    grad_norm, finite = finish(grads, 4.0, max_grad_norm=1.0)
    assert not finite and math.isnan(grad_norm)
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g.nan_to_num(7.0), b.nan_to_num(7.0))  # not divided, not clipped


def test_a_bf16_gradient_divided_and_clipped_is_rounded_once():
    # The division and the clip are one multiplication in float32, rounded once to bf16:
    # every element within bf16's half unit of the exact mean-and-clip (float64, torch alone).
    # A clip coefficient rounded to bf16 first (torch's clip_grad_norm_ on bf16 gradients)
    # can be a whole unit off on top of that.
    g = torch.Generator().manual_seed(3)
    summed = [(torch.randn(400, generator=g) * 50).to(torch.bfloat16) for _ in range(3)]
    divisor, max_norm = 7.0, 0.3
    exact = [s.double() / divisor for s in summed]
    norm = float(torch.linalg.vector_norm(torch.cat(exact)))
    exact = [e * (max_norm / (norm + 1e-6)) for e in exact]
    grads = [s.clone() for s in summed]
    grad_norm, steps = finish(grads, divisor, max_norm)
    assert steps and grad_norm == pytest.approx(norm, rel=1e-6)
    for got, want in zip(grads, exact, strict=True):
        assert got.dtype == torch.bfloat16
        # bf16 keeps 8 significant bits: rounding is off by 2**-8 of the value at most
        assert float(((got.double() - want) / want).abs().max()) <= 2.0**-8 * (1 + 2.0**-20)


def test_total_norm_widens_low_precision_and_mixes_dtypes():
    exact = [torch.full((1000,), 0.01, dtype=torch.float64), torch.full((3,), 2.0)]
    expected = math.sqrt(1000 * 0.01**2 + 3 * 4.0)
    mixed = [exact[0].to(torch.bfloat16), exact[1]]
    assert float(total_norm(exact)) == pytest.approx(expected, rel=1e-7)  # fp32 part: fp32
    # bf16 holds 0.01 to 3 digits; the sum of its squares must not be rounded to bf16 too
    bf16_value = float(torch.tensor(0.01, dtype=torch.bfloat16))
    assert float(total_norm(mixed)) == pytest.approx(
        math.sqrt(1000 * bf16_value**2 + 12.0), rel=1e-6
    )
    assert float(total_norm([])) == 0.0


# -- one tally on every path -------------------------------------------------------------------


def window_gradient(model) -> dict[str, torch.Tensor]:
    """The gradient the optimizer steps on: SGD at lr 1 moves each weight by exactly it."""
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_accumulator_the_framework_window_and_the_pipeline_window_share_one_tally(
    one_process_group,
):
    """Padded sequences in 4 micro-batches of 4, 3, 3 and 3 (how the pipeline's schedule cuts
    13): every micro-batch holds a different number of tokens. All three paths must give the
    full batch's mean gradient, which torch alone computes here."""
    from torch.distributed.pipelining import PipelineStage

    from gradaccum.integrations.window import FrameworkWindow
    from gradaccum.pipeline import PipelineWindow

    batch = padded_lm_batch(seed=5)
    parts = split_sizes(batch, [4, 3, 3, 3])
    assert len({int((mb["labels"][:, 1:] != -100).sum()) for mb in parts}) == 4
    want = reference_grads(make_model(TinyLM), batch, lm_reference)

    def causal(out, labels):
        return ga.causal_lm_loss(out, labels)

    got = {}
    # The Accumulator, its step() (the gradient captured before the optimizer's step).
    model = make_model(TinyLM)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = ga.Accumulator(model, opt)
    captured = capture_step_grads(opt, model)
    acc.step(parts, lambda m, mb: causal(m(mb["input_ids"]), mb["labels"]))
    got["accumulator"] = captured[0]
    # A framework's loop: backward on each summed loss, the window told, then end().
    model = make_model(TinyLM)
    window = FrameworkWindow(model, None)
    for mb in parts:
        loss_sum, count = causal(model(mb["input_ids"]), mb["labels"])
        loss_sum.backward()
        window.add(loss_sum, count)
    end = window.end([p.grad for p in model.parameters()])
    got["framework"] = window_gradient(model)
    # A pipeline of one stage: the schedule cuts the batch itself.
    model = make_model(TinyLM)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = capture_step_grads(opt, model)
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    pipe = PipelineWindow(stage, opt, causal, 4, schedule="gpipe")
    result = pipe.step(batch["input_ids"], target=batch["labels"])
    got["pipeline"] = captured[0]

    tokens = int((batch["labels"][:, 1:] != -100).sum())
    assert end.count == result.count == tokens
    for path, grads in got.items():
        assert max_rel_err(grads, want) <= 1e-5, path


# -- one close for every path: the same window, the same result --------------------------------

# Five windows: uneven micro-batches (how a pipeline schedule cuts 13 and 7 rows: 4, 3, 3, 3
# and 2, 2, 2, 1; every micro-batch a different number of tokens), a non-finite window (the
# third: its loss times NaN) and a ragged last window of 7 rows.
WINDOWS = [(13, 11, False), (13, 12, False), (13, 13, True), (13, 14, False), (7, 15, False)]
MICRO = 4


def _poisoned(flag):
    def loss(out, labels):
        loss_sum, count = ga.causal_lm_loss(out, labels)
        return (loss_sum * float("nan") if flag["on"] else loss_sum), count

    return loss


def _reference_window(model, batch, parts):
    """torch alone, on a copy of the model: the full batch's mean loss and gradient, and the
    window's noise estimates (|G|^2, tr(Sigma)) from its prefixes' mean gradients fitted
    by least squares on (1 / B_i, |G_{B_i}|^2)."""
    loss = lm_reference(model, batch)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    points = []
    for i in range(1, len(parts) + 1):
        prefix = {k: torch.cat([p[k] for p in parts[:i]]) for k in batch}
        g = torch.autograd.grad(lm_reference(model, prefix), list(model.parameters()))
        tokens = int((prefix["labels"][:, 1:] != -100).sum())
        points.append((1 / tokens, float(sum(x.double().square().sum() for x in g))))
    x = torch.tensor([[1.0, p[0]] for p in points], dtype=torch.float64)
    y = torch.tensor([[p[1]] for p in points], dtype=torch.float64)
    g2, trace = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    names = [n for n, _ in model.named_parameters()]
    return float(loss.detach()), dict(zip(names, grads, strict=True)), (g2, trace)


def test_every_path_closes_a_window_alike_through_the_one_close(one_process_group, caplog):
    """The Accumulator, a framework's loop through FrameworkWindow, and a pipeline of one
    stage, with a max_grad_norm, a scheduler (the framework's loop has its own), and a
    NoiseScale each: the same loss, gradient, norm, skip decision and noise reading at every
    window, against the full batch and its prefixes computed with torch alone. The pipeline
    now warns on the skipped window and steps its scheduler on every other."""
    from torch.distributed.pipelining import PipelineStage

    from gradaccum.integrations.window import FrameworkWindow
    from gradaccum.pipeline import PipelineWindow

    flag = {"on": False}
    loss = _poisoned(flag)
    clip = 0.5

    def build():
        model = make_model(TinyLM)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return model, opt, sched, capture_step_grads(opt, model)

    acc_model, acc_opt, acc_sched, acc_seen = build()
    acc = ga.Accumulator(
        acc_model,
        acc_opt,
        scheduler=acc_sched,
        max_grad_norm=clip,
        noise=ga.NoiseScale(horizon=1.0),
    )
    fw_model, fw_opt, fw_sched, fw_seen = build()
    framework = FrameworkWindow(fw_model, ga.NoiseScale(horizon=1.0))
    pipe_model, pipe_opt, pipe_sched, pipe_seen = build()
    stage = PipelineStage(pipe_model, 0, 1, torch.device("cpu"))
    pipe = PipelineWindow(
        stage,
        pipe_opt,
        loss,
        MICRO,
        max_grad_norm=clip,
        scheduler=pipe_sched,
        noise=ga.NoiseScale(horizon=1.0),
    )
    reference = make_model(TinyLM)
    fits = []
    for index, (rows, seed, poisoned) in enumerate(WINDOWS):
        batch = padded_lm_batch(seed, rows)
        parts = [
            dict(zip(batch, p, strict=True))
            for p in zip(*(torch.tensor_split(v, MICRO) for v in batch.values()), strict=True)
        ]
        want_loss, want_grads, fit = _reference_window(reference, batch, parts)
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        flag["on"] = poisoned
        results = {}
        caplog.clear()
        results["accumulator"] = acc.step(
            parts, lambda m, mb: loss(m(mb["input_ids"]), mb["labels"])
        )
        for mb in parts:  # a framework's loop: backward of each summed loss, then end()
            loss_sum, count = framework.record(*loss(fw_model(mb["input_ids"]), mb["labels"]))
            loss_sum.backward()
            framework.after_backward(count, [p.grad for p in fw_model.parameters()])
        results["framework"] = framework.end(
            [p.grad for p in fw_model.parameters()], max_grad_norm=clip
        )
        if results["framework"].stepped:
            fw_opt.step()
            fw_sched.step()
        fw_opt.zero_grad(set_to_none=True)
        with caplog.at_level("WARNING", logger="gradaccum"):
            results["pipeline"] = pipe.step(batch["input_ids"], target=batch["labels"])
        flag["on"] = False

        first = results["accumulator"]
        for path, result in results.items():
            if poisoned:  # the loss as the window summed it: NaN
                assert math.isnan(result.loss), path
            else:
                assert result.loss == pytest.approx(want_loss, rel=1e-5), path
            assert (result.stepped, result.skipped) == (first.stepped, first.skipped), path
            assert result.count == tokens and result.micro_batches == MICRO, path
            assert result.noise_scale == first.noise_scale, path
            assert result.noise_interval == first.noise_interval, path
        if poisoned:
            assert all(r.skipped == "non-finite gradient" for r in results.values())
            assert "window 3 skipped (non-finite gradient" in caplog.text  # the pipeline's
            assert len(acc_seen) == len(fw_seen) == len(pipe_seen) == index  # no step
            continue
        fits.append(fit)
        want_norm = float(
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in want_grads.values()])
            )
        )
        coef = min(1.0, clip / (want_norm + 1e-6))
        for path, result in results.items():
            assert result.grad_norm == pytest.approx(want_norm, rel=1e-5), path
        clipped = {k: g * coef for k, g in want_grads.items()}
        for path, seen in (
            ("accumulator", acc_seen),
            ("framework", fw_seen),
            ("pipeline", pipe_seen),
        ):
            assert max_rel_err(seen[-1], clipped) <= 1e-5, path
        with torch.no_grad():  # the reference takes the same step: SGD at LambdaLR's rate
            for name, p in reference.named_parameters():
                p -= _lr_before(index, WINDOWS) * clipped[name]
    # the scheduler stepped once per stepped window on the Accumulator and on the pipeline
    stepped = sum(not poisoned for *_, poisoned in WINDOWS)
    assert acc_sched.last_epoch == pipe_sched.last_epoch == fw_sched.last_epoch == stepped
    assert pipe.state.skipped_windows == acc.state.skipped_windows == 1
    g2, trace = (sum(f[i] for f in fits) / len(fits) for i in (0, 1))
    for noise in (acc.noise, framework.noise, pipe.noise):
        got = noise.estimates()
        assert got[0] == pytest.approx(g2, rel=1e-4) and got[1] == pytest.approx(trace, rel=1e-4)
    assert first.noise_scale is not None  # a reading, equal on every path


def _lr_before(index, windows):
    """LambdaLR's 0.5 / (1 + steps taken before this window)."""
    steps = sum(not poisoned for *_, poisoned in windows[:index])
    return 0.5 / (1 + steps)


# -- one host synchronization per window on an accelerator -------------------------------------


class _SkipLarge(SkipPolicy):
    """A user's skip policy, decided on the device: a non-finite norm or one over 100."""

    def skips(self, grad_norm):
        return torch.isfinite(grad_norm).logical_not() | (grad_norm > 100.0)

    def reason(self, scaled):
        return "too large"


@pytest.mark.parametrize(
    "noise,skip",
    [(False, None), (True, None), (True, _SkipLarge)],
    ids=["plain", "noise", "noise-skip-policy"],
)
def test_one_host_read_per_window_none_per_micro_batch_on_an_accelerator(noise, skip):
    """On a device that is not the CPU (tests/support/device.py counts every read of a value
    back to the host), with max_grad_norm, counts left on the device, a NoiseScale or none,
    and the default skip policy or a user's: nothing is read while the micro-batches run,
    and each window's end reads its numbers once, through the manual API and step() alike,
    a skipped window too. The results and the parameters are the CPU's, bit for bit."""
    from support.device import OnDevice, host, on_device

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))

    def loss_fn(m, mb):
        x, y, factor = mb
        loss = torch.nn.functional.cross_entropy(m(x), y, ignore_index=-100, reduction="sum")
        return loss * factor, (y != -100).sum()

    def accumulator(net):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        return ga.Accumulator(
            net,
            optimizer,
            max_grad_norm=0.5,
            noise=ga.NoiseScale() if noise else None,
            skip=None if skip is None else skip(),
        )

    acc, cpu = accumulator(on_device(model())), accumulator(model())
    g = torch.Generator().manual_seed(1)
    for w in range(6):
        window = []
        for i in range(3):
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 5, (4,), generator=g)
            y[:i] = -100  # 4, 3 and 2 items
            factor = float("nan") if (w, i) == (3, 1) else 1e4 if (w, i) == (4, 0) else 1.0
            window.append((x, y, factor))
        on_device_window = [(OnDevice(x), OnDevice(y), f) for x, y, f in window]
        OnDevice.reads.clear()
        if w % 2:
            for i, mb in enumerate(on_device_window):
                with acc.micro_batch():
                    acc.backward(*loss_fn(acc.model, mb))
                assert OnDevice.reads == [], f"micro-batch {i} of window {w}: {OnDevice.reads}"
            got = acc.end_window()
        else:
            got = acc.step(on_device_window, loss_fn)
        assert len(OnDevice.reads) == 1, f"window {w} read the host {OnDevice.reads}"
        want = cpu.step(window, loss_fn)
        assert isinstance(got.loss, float) and isinstance(got.grad_norm, float)
        skipped = {3} if skip is None else {3, 4}  # a large window: the policy's to skip
        assert got.skipped == want.skipped and (got.skipped is not None) == (w in skipped)
        assert got.count == want.count == 9
        if w != 3:
            assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
            assert (got.noise_scale, got.noise_interval) == (want.noise_scale, want.noise_interval)
    for p, q in zip(acc.model.parameters(), cpu.model.parameters(), strict=True):
        assert torch.equal(host(p), q)  # the CPU's steps, bit for bit


# -- what a window keeps between its micro-batches ---------------------------------------------


def _tensors_held(obj, seen=None) -> int:
    """Tensors reachable from ``obj`` through its attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_tensors_held(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensors_held(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("gradaccum"):
        return _tensors_held(vars(obj), seen)
    return 0


@pytest.mark.parametrize("named", [False, True], ids=["pair", "terms"])
def test_a_window_keeps_no_tensor_per_micro_batch_on_the_cpu(named):
    """What a window keeps between micro-batches (its tally: the loss so far, the counts) is
    the same few tensors after 2 micro-batches as after 16. A small tensor kept per
    micro-batch is made between that micro-batch's activations and pins glibc's heap where
    they were freed: a run of 16 micro-batches per window peaked 43% above its plan with
    glibc as it comes (bench/results/planner.md)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    acc = ga.Accumulator(net, torch.optim.SGD(net.parameters(), lr=0.1))
    held = []
    for n in (2, 16):
        if named:
            acc.begin_window({"ce": 3 * n, "aux": n})
        for _ in range(n):
            with acc.micro_batch():
                out = net(torch.randn(3, 4))
                loss_sum = out.square().sum()
                count = torch.tensor(3)  # a count as a CPU tensor: read now, nothing kept
                if named:
                    acc.backward({"ce": (loss_sum, count), "aux": (out.sum(), 1, 0.1)})
                else:
                    acc.backward(loss_sum, count)
        held.append(_tensors_held(acc._window.tally))
        acc.end_window()
    assert held[0] == held[1], f"tensors kept after 2 and 16 micro-batches: {held}"
