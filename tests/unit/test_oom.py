"""Out-of-memory inside a window: replay it smaller, lose no sample, grow back later."""

import pytest
import torch
import torch.nn.functional as F
from helpers import MLP, make_model, max_rel_err, params
from support.faults import inject_oom

import gradaccum as ga


def data(seed, n=32):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 6, generator=g),
        "y": torch.randn(n, 3, generator=g),
        "idx": torch.arange(n) + 1000 * seed,
    }


class Recorder:
    """A loss_fn on a device that fits ``fits`` samples (a threshold it can change) and
    records which samples and micro-batch sizes the successful attempt of each window ran."""

    def __init__(self, fits):
        self.fits = fits
        self.attempt = []  # sample ids of the current attempt
        self.sizes = []

    def loss_fn(self, model, mb):
        try:
            return inject_oom(self.record, self.fits)(model, mb)
        except torch.OutOfMemoryError:
            self.attempt, self.sizes = [], []  # that attempt is dropped whole
            raise

    def record(self, model, mb):
        self.attempt += mb["idx"].tolist()
        self.sizes.append(len(mb["idx"]))
        return ga.sample_mean(F.mse_loss(model(mb["x"]), mb["y"], reduction="none"))

    def new_window(self):
        self.attempt, self.sizes = [], []


def run(recorder, windows, grow_after=50, **kw):
    model = make_model(MLP)
    acc = ga.Accumulator(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        oom=ga.OOMReplay(grow_after=grow_after),
        **kw,
    )
    results, seen, sizes = [], [], []
    rec = recorder or Recorder(fits=10**9)
    for w in windows:
        rec.new_window()
        results.append(acc.step(ga.split(w, 8), rec.loss_fn))
        seen.append(sorted(rec.attempt))
        sizes.append(list(rec.sizes))
    return model, acc, results, seen, sizes


def test_replayed_window_matches_an_uninjected_run_and_keeps_every_sample_once(caplog):
    windows = [data(s) for s in range(3)]
    clean_model, _, clean_results, _, clean_sizes = run(None, windows)
    rec = Recorder(fits=3)  # 8 fails, 4 fails, 2 fits
    model, acc, results, seen, sizes = run(rec, windows)

    assert clean_sizes[0] == [8, 8, 8, 8]
    assert results[0].oom_replays == 2 and sizes[0] == [2] * 16
    assert [r.oom_replays for r in results[1:]] == [0, 0]  # the cap holds for later windows
    for w, ids in zip(windows, seen, strict=True):
        assert ids == sorted(w["idx"].tolist())  # every sample once: none dropped or doubled
    assert [r.count for r in results] == [r.count for r in clean_results] == [32, 32, 32]
    assert acc.state.items == 96 and acc.state.oom_replays == 2
    err = max_rel_err(params(model), params(clean_model))
    print(f"replayed vs uninjected parameters after 3 AdamW steps: {err:.2e}")
    assert err <= 1e-6  # same samples, different split: fp32 rounding only
    assert "out of memory at micro-batch size 8; replaying the window at 4" in caplog.text


def test_the_micro_batch_grows_back_after_clean_windows_never_above_the_given_size():
    rec = Recorder(fits=4)
    windows = [data(s) for s in range(6)]
    model = make_model(MLP)
    acc = ga.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.01), oom=ga.OOMReplay(grow_after=2)
    )
    sizes = []
    for i, w in enumerate(windows):
        if i == 1:
            rec.fits = 10**9  # memory frees up
        rec.new_window()
        acc.step(ga.split(w, 8), rec.loss_fn)
        sizes.append(max(rec.sizes))
    # window 0 shrinks to 4; windows 1 and 2 are clean at 4; then it grows back to 8, the
    # size given, and stays there (the limit) however many clean windows follow
    assert sizes == [4, 4, 4, 8, 8, 8]
    assert acc.oom.cap is None


def test_what_cannot_be_replayed_still_raises():
    model = make_model(MLP)
    one = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), oom=ga.OOMReplay())
    rec = Recorder(fits=0)
    with pytest.raises(torch.OutOfMemoryError):  # even one sample does not fit
        one.step(ga.split(data(0, n=4), 1), rec.loss_fn)
    off = ga.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), oom=None)
    with pytest.raises(torch.OutOfMemoryError):
        off.step(ga.split(data(0), 8), Recorder(fits=2).loss_fn)
    assert all(p.grad is None for p in model.parameters())


def test_the_cap_survives_a_checkpoint(tmp_path):
    rec = Recorder(fits=4)
    model, acc, *_ = run(rec, [data(0)])
    assert acc.oom.cap == 4
    torch.save(acc.state_dict(), tmp_path / "c.pt")
    other = make_model(MLP, seed=5)
    acc2 = ga.Accumulator(other, torch.optim.AdamW(other.parameters(), lr=1e-2), oom=ga.OOMReplay())
    acc2.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    assert acc2.oom.cap == 4 and acc2.state.oom_replays == 1


def test_policy_arguments():
    with pytest.raises(ValueError, match="grow_after must be an integer >= 1, got 0"):
        ga.OOMReplay(grow_after=0)
    with pytest.raises(ValueError, match="max_fitting_size must be an integer, got 2.5"):
        inject_oom(Recorder(fits=1).record, 2.5)
