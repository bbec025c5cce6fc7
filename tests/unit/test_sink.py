"""gradaccum.app.report.sink: a step's numbers to metrics.jsonl, the log line after the
first window, every 10 s and at each tenth of the run, a time left that does not swing, and
memory.json at the end; nothing on a process that does not write."""

import json
from types import SimpleNamespace

from gradaccum.app.folder import MEMORY, METRICS, RunFolder
from gradaccum.app.report.metrics import STEP
from gradaccum.app.report.sink import MetricsSink, duration, step_line
from gradaccum.app.run import Progress
from gradaccum.schedule import BatchSchedule


def progress(total_steps=10):
    return Progress(BatchSchedule("constant", start=8, unit=8), total_steps, None)


def sink(folder, p, said, writes=True):
    return MetricsSink(
        folder, p, "sample", said.append, writes=writes, tensorboard=False,
        max_grad_norm=None, stopped=lambda what: f"{what}; stopped",
    )  # fmt: skip


def line(step):
    return {"step": step, "samples": 8 * step, "effective_batch": 8, "loss": 1.0 / step,
            "peak_memory": 2**20}  # fmt: skip


def test_the_line_keeps_the_tables_order():
    values = {"noise_high": 3.0, "loss": 1.0, "step": 2, "lr": 0.1}
    assert list(step_line(values)) == ["step", "loss", "lr", "noise_high"]
    assert list(step_line(values)) == [m.name for m in STEP if m.name in values]


def test_lines_are_written_and_a_log_line_said_at_each_tenth(tmp_path):
    folder, p, said = RunFolder(tmp_path), progress(20), []
    s = sink(folder, p, said)
    s.open(0)
    for step in range(1, 5):
        before = p.fraction()
        p.schedule.step = step
        s.write(line(step), None, 100.0, before)
    meter = SimpleNamespace(phases={"training": 5}, peak=lambda: 7)
    s.close(meter, carried=3)
    assert [x["step"] for x in folder.metrics()] == [1, 2, 3, 4]
    # the first window's, then 10% and 20% (the windows take no time: no line for time)
    assert [x.split()[1] for x in said] == ["1/20", "2/20", "4/20"]
    assert "loss 0.250 nats/sample" in said[-1] and "mem 1.0 MiB" in said[-1]
    assert json.loads((tmp_path / MEMORY).read_text()) == {
        "peak": 7, "phases": {"training": 5}, "carried": 3,
    }  # fmt: skip


def test_a_rollback_cuts_the_lines_back(tmp_path):
    folder, p, said = RunFolder(tmp_path), progress(), []
    s = sink(folder, p, said)
    s.open(0)
    for step in range(1, 4):
        s.write(line(step), None, 1.0, 0.0)
    s.restart(1)
    s.write(line(2), None, 1.0, 0.0)
    assert [x["step"] for x in folder.metrics()] == [1, 2]


def test_a_process_that_does_not_write_writes_nothing(tmp_path):
    s = sink(RunFolder(tmp_path), progress(), [], writes=False)
    s.open(0)
    s.write(line(1), None, 1.0, 0.0)
    s.close(SimpleNamespace(phases={"training": 1}, peak=lambda: 1), 0)
    assert not (tmp_path / METRICS).exists() and not (tmp_path / MEMORY).exists()


def test_durations():
    assert [duration(s) for s in (45, 185, 3720)] == ["45s", "3m05s", "1h02m"]


def test_the_time_left_is_the_recent_windows_pace_once_a_few_have_run(tmp_path):
    folder, p, said = RunFolder(tmp_path), progress(100), []
    s = sink(folder, p, said)
    s.open(0)
    # a first window of 50 s (warm-up), then windows of 2 s, then of 4 s (the machine loaded)
    seconds = [50.0] + [2.0] * 3 + [4.0] * 10
    for step, took in enumerate(seconds, start=1):
        p.schedule.step = step
        s.write({**line(step), "seconds": took}, None, 1.0, (step - 1) / 100)
        if step <= 3:  # the warm-up and two windows: too few to say
            assert s.console.time_left(line(step)) is None
        if step == 4:  # three 2 s windows, the warm-up left out
            assert s.console.time_left(line(4)) == 96 * 2.0
    # the last ten windows are 4 s each: 86 steps left at 4 s, not the session's average
    assert s.console.time_left(line(14)) == 86 * 4.0
    # the log line at 10% (step 10): nine windows since the warm-up, 30 s, for 90 steps left
    assert said[-1].startswith("step    10/100") and said[-1].endswith("ETA 5m00s"), said


def test_the_time_left_counts_the_evaluations_and_checkpoints_still_to_come(tmp_path):
    """Windows of 2 s, a 10 s evaluation after every 5th step, a 4 s checkpoint after every
    10th: at step 20 of 100, what is left is 80 windows, 16 evaluations and 8 checkpoints,
    352 s. The windows' pace alone says 160 s; the time left adds what the run has spent per
    step outside its windows so far (here 44 s over 20 steps: the checkpoint after step 20
    is still to be paid), so it reads 336 s."""
    folder, p, said = RunFolder(tmp_path), progress(100), []
    now = [0.0]
    s = MetricsSink(
        folder, p, "sample", said.append, writes=True, tensorboard=False,
        max_grad_norm=None, stopped=lambda what: what, clock=lambda: now[0],
    )  # fmt: skip
    s.open(0)
    for step in range(1, 21):
        before = p.fraction()
        p.schedule.step = step
        now[0] += 2.0  # the window
        if step % 5 == 0:
            now[0] += 10.0  # its evaluation, before the line is written
        s.write({**line(step), "seconds": 2.0}, None, 1.0, before)
        if step % 10 == 0:
            now[0] += 4.0  # the checkpoint, after it
    truly_left = 80 * 2.0 + 16 * 10.0 + 8 * 4.0
    left = s.console.time_left(line(20))
    assert abs(left - truly_left) <= 0.05 * truly_left and left == 80 * (2.0 + 44 / 20)
    assert said[-1].startswith("step    20/100") and said[-1].endswith("ETA 5m36s"), said
    # a rollback's own time is not the run's pace: what is outside the windows is counted
    # again from there
    now[0] += 500.0
    s.restart(20)
    p.schedule.step = 21
    now[0] += 2.0
    s.write({**line(21), "seconds": 2.0}, None, 1.0, 0.2)
    assert s.console.time_left(line(21)) == 79 * 2.0


def clocked(folder, p, said, now):
    return MetricsSink(
        folder, p, "sample", said.append, writes=True, tensorboard=False,
        max_grad_norm=None, stopped=lambda what: what, clock=lambda: now[0],
    )  # fmt: skip


def eta(text: str) -> float | None:
    """The seconds an ETA in a log line says (None: none said)."""
    if " ETA " not in text:
        return None
    word = text.rsplit(" ETA ", 1)[1]
    if "h" in word:
        h, m = word.rstrip("m").split("h")
        return int(h) * 3600 + int(m) * 60
    if "m" in word:
        m, sec = word.rstrip("s").split("m")
        return int(m) * 60 + int(sec)
    return int(word.rstrip("s"))


def test_a_line_after_the_first_window_then_at_least_every_ten_seconds(tmp_path):
    """The demo's first line came minutes into training, then every 15 steps: now the first
    window's line at once, then no gap between lines over 10 s (windows of 3 s, a 1,000-step
    run whose tenths are 5 minutes apart)."""
    folder, p, said, now = RunFolder(tmp_path), progress(1000), [], [0.0]
    s = clocked(folder, p, said, now)
    s.open(0)
    times = []
    for step in range(1, 61):
        before = p.fraction()
        p.schedule.step = step
        now[0] += 3.0
        count = len(said)
        s.write({**line(step), "seconds": 3.0}, None, 1.0, before)
        if len(said) > count:
            times.append(now[0])
    assert times[0] == 3.0  # the first window's line, when it ends
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= 10.0 and max(gaps) >= 9.0, gaps  # every 10 s, not every window
    assert 180.0 - times[-1] <= 10.0


def test_the_time_left_said_does_not_swing_and_is_right_on_a_steady_run(tmp_path):
    """Windows of 1 s with an evaluation of 20 s every 50 steps, then the machine loaded
    (windows of 6 s) for 30 steps, then quiet again: once 10 windows have run, no line's time
    left is more than twice or less than half the line's before (less the time between),
    and on the steady stretch after the load it is the run's true time left within one
    evaluation (the evaluations still to come are counted at the rate per step the run has
    paid them, not at their steps)."""
    total = 400
    folder, p, said, now = RunFolder(tmp_path), progress(total), [], [0.0]
    s = clocked(folder, p, said, now)
    s.open(0)

    def took(step):
        return 6.0 if 120 < step <= 150 else 1.0

    said_at: list[tuple[int, float, float]] = []  # step, clock, the ETA said
    for step in range(1, total + 1):
        before = p.fraction()
        p.schedule.step = step
        now[0] += took(step)
        if step % 50 == 0:
            now[0] += 20.0  # the evaluation, before its line
        count = len(said)
        s.write({**line(step), "seconds": took(step)}, None, 1.0, before)
        if len(said) > count and eta(said[-1]) is not None:
            said_at.append((step, now[0], eta(said[-1])))
    later = [x for x in said_at if x[0] > 11]
    for (_, t0, a), (step, t1, b) in zip(later, later[1:], strict=False):
        expected = max(a - (t1 - t0), 1.0)
        assert expected / 2.0 - 1 <= b <= expected * 2.0 + 1, (step, a, b, t1 - t0)
    # the steady stretch after the load: the true time left (windows and evaluations)
    checked = 0
    for step, _, shown in said_at:
        if 250 <= step <= 300:
            left = (total - step) + 20.0 * (total // 50 - step // 50)
            assert abs(shown - left) <= 20.0, (step, shown, left)
            checked += 1
    assert checked >= 3
