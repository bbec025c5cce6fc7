"""The run report: one self-contained page from a real run folder, with every number where it
belongs, nothing fetched from outside, every string escaped, and the CLI's exit statuses."""

import base64
import html
import json
import re
import shutil
from html.parser import HTMLParser

import pytest
import torch

from gradaccum.app import TrainConfig, train
from gradaccum.app.cli import main
from gradaccum.app.report.html import render, write_report

torch.set_num_threads(1)

PNG = b"\x89PNG\r\n\x1a\n"
# Attributes that make a browser fetch or navigate somewhere.
LINKS = {"src", "href", "action", "formaction", "poster", "data", "background", "srcset"}


class Page(HTMLParser):
    """The parts of a page the tests look at: tags with their attributes, table rows as
    lists of cell texts, the status line, the title and the style sheet."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.rows: list[list[str]] = []
        self.title = self.status = self.style = ""
        self._cell: list[str] | None = None
        self._in = ""
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag in ("title", "style") or (tag == "p" and "status" in attrs.get("class", "")):
            self._in = "status" if tag == "p" else tag

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None
        elif tag in ("title", "style", "p"):
            self._in = ""

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._in:
            setattr(self, self._in, getattr(self, self._in) + data)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "digits-run"
    cfg = TrainConfig.of(
        recipe="digits",
        steps=4,
        micro_batch=16,
        effective_batch=32,
        eval_every=2,
        checkpoint_every=2,
        out=str(run),
        noise_scale=False,
    )
    train(cfg, log=lambda *a, **k: None)
    return run


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run folder that a test may change."""
    copy = tmp_path / trained.name
    shutil.copytree(trained, copy, ignore=shutil.ignore_patterns("checkpoint.pt", ".lock"))
    return copy


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def test_the_printed_summary_counts_with_thousands_separators(trained):
    from gradaccum.app.report.summary import summary_table

    summary = json.loads((trained / "summary.json").read_text())
    summary["items"], summary["samples"] = 1_219_200, 9_600  # a demo's counts
    rows = dict(line.split("  ", 1) for line in summary_table(summary).splitlines() if "  " in line)
    # the recipe's own item names the count (issue 58: "items seen" where the items were
    # bytes); digits' items are images
    assert rows["images seen"].strip() == "1,219,200" and rows["samples seen"].strip() == "9,600"
    assert "items seen" not in rows
    assert rows["optimizer steps"].strip() == "4"


def test_the_page_holds_the_runs_numbers_and_its_plots(run):
    summary = json.loads((run / "summary.json").read_text())
    page = Page(render(run))
    assert page.title == "gradaccum run digits-run"
    assert page.status == "finished: trained its full length, 4 optimizer steps"
    rows = page.rows
    assert ["optimizer steps", "4"] in rows
    assert ["samples seen", "128"] in rows
    assert ["held-out loss", f"{summary['held_out_loss']:.4f}"] in rows
    assert ["held-out accuracy", f"{summary['held_out_accuracy']:.4f}"] in rows
    assert ["peak training memory", mib(summary["peak_memory"])] in rows
    assert ["micro-batch", "16 samples; given with --micro-batch"] in rows  # the plan
    assert ["effective_batch", "32"] in rows and ["recipe", "digits"] in rows  # the config
    assert ["lora", "null"] in rows  # folded, at its default

    images = [attrs for tag, attrs in page.tags if tag == "img"]
    plots = sorted(run.glob("*.png"))
    assert len(plots) == 3 and len(images) == len(plots)
    for attrs in images:
        prefix = "data:image/png;base64,"
        assert attrs["src"].startswith(prefix)
        data = base64.b64decode(attrs["src"][len(prefix) :], validate=True)
        assert data.startswith(PNG)
        assert attrs.get("alt", "").strip()
    embedded = {base64.b64decode(a["src"].split(",", 1)[1]) for a in images}
    assert embedded == {p.read_bytes() for p in plots}


def test_the_page_references_nothing_outside_itself(run):
    text = render(run)
    page = Page(text)
    for tag, attrs in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed", "base"), tag
        for name, value in attrs.items():
            value = value or ""
            if name in LINKS:
                assert value.startswith(("data:", "#")), (tag, name, value[:80])
            assert "url(" not in value, (tag, name, value)
    assert not re.findall(r"url\(\s*['\"]?(?!data:)", page.style)
    assert "@import" not in page.style
    # Outside the embedded images (base64 may hold "//"), no address of any kind.
    bare = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:", text)
    for marker in ("http:", "https:", "//", "ws:", "file:"):
        assert marker not in bare, marker
    # and the browser is told to fetch nothing, should anything slip in
    csp = [a["content"] for t, a in page.tags if a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0] and "img-src data:" in csp[0]


def test_targets_stop_incidents_and_unknown_keys_show_escaped(run):
    summary = json.loads((run / "summary.json").read_text())
    summary["stopped_by"] = "target_loss"
    summary["incidents"] = 1
    summary["future_field"] = "<b>bold</b>"
    not_set = {"limit": None, "status": "not set", "value": None, "step": None}
    summary["targets"] = {
        "target_loss": {"limit": 2.0, "status": "met", "value": 1.9, "step": 3, "samples": 96,
                        "seconds": 0.25},
        "target_accuracy": not_set,
        "max_time": {"limit": 3600, "status": "within", "value": 12.5, "step": None},
        "max_memory": {"limit": 2**30, "status": "within", "value": 3 * 2**20, "step": None},
    }  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    incident = {
        "step": 3,
        "samples": [64, 96],
        "kind": "loss spike",
        "seen": {"loss": 9.5, "loss_median": 2.25, "loss_threshold": 6.0},
        "action": "rolled back <script>alert(1)</script> & retried",
        "rolled_back_to": 2,
        "retry": 1,
        "new_key": "<i>x</i>",
    }
    (run / "incidents.jsonl").write_text(json.dumps(incident) + "\n")

    text = render(run)
    assert "<script>" not in text and "<b>bold</b>" not in text and "<i>x</i>" not in text
    assert "rolled back &lt;script&gt;alert(1)&lt;/script&gt; &amp; retried" in text
    page = Page(text)
    assert not [t for t, _ in page.tags if t in ("script", "b", "i")]
    assert page.status == "finished early: met the loss target (2.0000) at step 3"
    rows = page.rows
    assert ["", "limit", "status", "value", "when"] in rows
    assert ["target loss", "2.0000", "met", "1.9000", "step 3, 96 samples, 0.2 s"] in rows
    assert ["target accuracy", "—", "not set", "—", "—"] in rows
    assert ["time limit", "1 h 00 min", "within", "12.5 s", "—"] in rows
    assert ["memory limit", "1.0 GiB", "within", "3.0 MiB", "—"] in rows
    head = ["step", "samples", "kind", "seen", "action", "rolled back to", "retry", "other"]
    assert head in rows
    row = rows[rows.index(head) + 1]
    assert row[:3] == ["3", "[64, 96)", "loss spike"]
    assert row[3] == "loss: 9.5000\nloss_median: 2.2500\nloss_threshold: 6.0000"
    assert row[4:] == [incident["action"], "step 2", "1", "new_key: <i>x</i>"]
    assert ["future field", "<b>bold</b>"] in rows  # unknown keys are shown, not dropped
    assert ["incidents", "1"] in rows


@pytest.mark.parametrize(
    "stopped_by, status",
    [
        ("guard", "stopped by the incident guard at step 4: it gave up (see the incidents below)"),
        ("max_time", "stopped by its time limit (10.0 s) at step 4"),
        ("length", "finished: trained its full length, 4 optimizer steps"),
        ("something new", "stopped by something new at step 4"),
    ],
)
def test_the_status_line_names_what_stopped_the_run(run, stopped_by, status):
    summary = json.loads((run / "summary.json").read_text())
    summary["stopped_by"] = stopped_by
    summary["targets"] = {"max_time": {"limit": 10.0, "status": "reached", "value": 10.2}}
    (run / "summary.json").write_text(json.dumps(summary))
    assert Page(render(run)).status == status


def test_an_unfinished_run_and_a_resume(run):
    (run / "summary.json").unlink()
    (run / "metrics.jsonl").write_text(
        (run / "metrics.jsonl").read_text() + '{"step": 5, "loss": 1.'  # a crash's half line
    )
    (run / "resumes.jsonl").write_text(json.dumps({"step": 2, "changed": {"steps": [2, 4]}}))
    page = Page(render(run))
    assert page.status == "not finished: no summary.json; metrics up to step 4"
    assert ["step", "4"] in page.rows  # the last whole metrics line stands in for the summary
    assert ["resumed at step", "what changed"] in page.rows
    assert ["2", "steps: 2 → 4"] in page.rows


def test_no_incidents_and_no_targets_say_so(run):
    summary = json.loads((run / "summary.json").read_text())
    for key in ("targets", "stopped_by", "incidents"):  # as a run from before they existed
        summary.pop(key, None)
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "incidents.jsonl").unlink(missing_ok=True)
    text = render(run)
    assert "<p>no incidents</p>" in text
    assert 'id="targets"' not in text  # no section at all
    assert Page(text).status == "finished: trained its full length, 4 optimizer steps"
    not_set = {"limit": None, "status": "not set", "value": None}
    summary["targets"] = {"target_loss": not_set, "max_time": not_set}
    (run / "summary.json").write_text(json.dumps(summary))
    assert '<p class="dim">no targets or limits were set</p>' in render(run)


def test_damaged_files_are_one_line_errors_naming_the_file(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2 is not valid JSON") as err:
        render(run)
    assert "\n" not in str(err.value)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text('{"steps": 4,')
    with pytest.raises(ValueError, match=r"summary\.json is not valid JSON") as err:
        render(run)
    assert "\n" not in str(err.value)
    (run / "summary.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"summary\.json holds list, not a JSON object"):
        render(run)


def test_no_run_there(tmp_path):
    with pytest.raises(ValueError, match=r"holds no gradaccum run \(no config\.json\)"):
        render(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match=r"file\.txt is a file, not a folder"):
        render(tmp_path / "file.txt")
    with pytest.raises(ValueError, match=r"missing does not exist"):
        render(tmp_path / "missing")


def test_write_report_default_and_out(run, tmp_path):
    written = write_report(run)
    assert written == run / "report.html"
    assert written.read_text() == render(run)
    elsewhere = write_report(run, tmp_path / "elsewhere.html")
    assert elsewhere.read_text() == written.read_text()
    assert not list(tmp_path.glob("*.tmp")) and not list(run.glob("*.tmp"))
    with pytest.raises(ValueError, match=r"folder .*no-such-folder does not exist"):
        write_report(run, tmp_path / "no-such-folder" / "r.html")
    folder = tmp_path / "reports"
    folder.mkdir()
    assert write_report(run, folder) == folder / "report.html"  # a folder: the page in it


def test_the_page_renders_the_summary_it_is_given_without_reading_it_back(run):
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()  # what the end of a run has computed, not yet on disk
    given = {**summary, "steps": 7}
    page = Page(render(run, summary=given, metrics=[]))
    assert ["optimizer steps", "7"] in page.rows
    assert page.status == "finished: trained its full length, 7 optimizer steps"
    assert Page(render(run)).rows != page.rows  # read from the folder: no summary there


def test_every_number_a_run_writes_is_in_the_one_metrics_table(run):
    """metrics.jsonl's keys are the table's STEP names (and the recipe's eval_* ones), and
    summary.json holds every SUMMARY name: a number the table does not know is a test failure,
    so a new metric is added to the table, which the summary, report and TensorBoard read."""
    from gradaccum.app.report.metrics import STEP, SUMMARY, item_label

    step_names = {m.name for m in STEP}
    for line in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()):
        assert {k for k in line if not k.startswith("eval_")} == step_names
    summary = json.loads((run / "summary.json").read_text())
    assert {m.name for m in SUMMARY} <= set(summary)
    labels = {r[0] for r in Page(render(run)).rows}
    assert {item_label(m.name, m.label, summary) for m in SUMMARY if m.page} <= labels


def test_cli_report(run, tmp_path, capsys):
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == str(run / "report.html")
    assert Page((run / "report.html").read_text()).title == "gradaccum run digits-run"
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").is_file()
    capsys.readouterr()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gradaccum: error: ")
    assert str(empty) in err and "config.json" in err
    assert not (empty / "report.html").exists()


def test_the_plan_section_reads_in_units_with_its_probes_as_a_table(tmp_path):
    """A planned run's plan.json as the page shows it (it was a raw dump: predicted_peak
    290092032, seconds 24.405726887999947, the probes as one JSON blob)."""
    from gradaccum.memory import format_bytes

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "gpt", "effective_batch": 64}))
    probe = {"micro_size": 4, "peak_bytes": 34_000_000, "activation_bytes": 17_000_000}
    plan = {
        "micro_size": 16,
        "budget": 200_000_000,
        "margin": 0.15,
        "predicted_peak": 167_138_304,
        "static_bytes": 1_000_000,
        "overhead_bytes": 2_000_000,
        "seconds": 21.584546108999348,
        "micro_sizes": [16, 16, 16, 16],
        "peak_fit": {"intercept": 4.7e6, "slope": 7.4e6, "max_error": 0.049, "bound": False},
        "probes": [{**probe, "predicted_bytes": 32_800_000.5, "kind": "fit"}],
    }
    (run / "plan.json").write_text(json.dumps(plan))
    rows = Page(render(run)).rows
    assert ["peak measured at the planned size", format_bytes(167_138_304)] in rows
    usable = format_bytes(200_000_000 * 0.85)
    budget = f"{format_bytes(200_000_000)} (200,000,000 bytes); 15% kept free, {usable} usable"
    assert ["budget", budget] in rows, rows
    assert ["planning took", "21.6 s"] in rows and ["micro-batches of a window", "4 x 16"] in rows
    assert ["peak line", "4.5 MiB + 7.1 MiB per sample (fit error 4.9%)"] in rows
    # the probe's row, each peak whole (static and first-step bytes, 3 MB, included)
    # its error as the fit's own (on the peak above the base), so "fit error" reads off it
    assert ["4", "fit", "35.3 MiB", "34.1 MiB", "-3.5%", "16.2 MiB"] in rows, rows


@pytest.mark.parametrize(
    "fit, said",
    [
        # the line above every probe (allocator noise): never a "fit error 1412%"
        (
            {"intercept": 1.09e7, "slope": 33_000, "max_error": 14.12, "bound": True},
            "10.4 MiB + 32.2 KiB per sample (a bound above every probe)",
        ),
        # a least-squares line that misses a probe by more than its value, falling
        (
            {"intercept": 2e6, "slope": -111.0, "max_error": 8.304, "bound": False},
            "1.9 MiB - 111 B per sample (no plausible line (it misses a probe by 830%): the "
            "peak measured at the planned size is what counts)",
        ),
    ],
)
def test_an_implausible_peak_line_is_said_to_be_one(tmp_path, fit, said):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "digits", "effective_batch": 64}))
    activations = {"intercept": 0.0, "slope": -109.0, "max_error": 8.3}
    plan = {"micro_size": 64, "peak_fit": fit, "activation_fit": activations}
    (run / "plan.json").write_text(json.dumps(plan))
    rows = Page(render(run)).rows
    assert ["peak line", said] in rows, rows
    (shown,) = [r[1] for r in rows if r[0] == "activations saved"]
    assert shown.startswith("too small here to fit a line per sample") and "-109" not in shown


def test_b_simple_and_counts_are_whole_numbers_on_the_page(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "gpt", "effective_batch": 64}))
    summary = {"steps": 3, "noise_scale": 3181.6051, "noise_interval": [2365.2, 5876.9]}
    (run / "summary.json").write_text(json.dumps({**summary, "items": 1219200.0}))
    rows = Page(render(run)).rows
    assert ["gradient noise scale B_simple (items)", "3,182"] in rows, rows
    assert ["its 90% interval", "2,365 to 5,877"] in rows


def test_batch_png_leaves_a_stretch_without_a_reading_as_a_gap(tmp_path):
    """B_simple read at windows 1-2 and 5-6, not at 3-4: its line has a gap there (it was
    drawn straight across)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    from gradaccum.app.report.plots import batch_plot

    class Kept:  # pyplot, keeping the axes batch_plot draws on
        def __init__(self):
            self.axes = []

        def subplots(self, **kw):
            fig, ax = pyplot.subplots(**kw)
            self.axes.append(ax)
            return fig, ax

        def close(self, fig):
            pyplot.close(fig)

    read = [True, True, False, False, True, True]
    lines = [
        {"step": i + 1, "samples": 64 * (i + 1), "count": 8000, "effective_batch": 64}
        | ({"noise_scale": 3000.0, "noise_low": 2000.0, "noise_high": 4000.0} if r else {})
        for i, r in enumerate(read)
    ]
    kept = Kept()
    batch_plot(kept, tmp_path, lines)
    [b_simple] = [line for line in kept.axes[0].lines if line.get_label() == "B_simple"]
    ys = list(b_simple.get_ydata())
    assert [not math.isnan(y) for y in ys] == read
    assert (tmp_path / "batch.png").stat().st_size > 0


def test_the_console_names_the_advised_batch_as_the_flag_to_give():
    """The library's advice names no flag; the command's summary renders its batch as
    --effective-batch N, after the measurement, with what a smaller batch costs."""
    from gradaccum.app.report.summary import noise_advice
    from gradaccum.noise import NoiseReading

    said = noise_advice(256, NoiseReading(112.0, 80.0, 160.0, 60, 0.9), 4.0).splitlines()
    assert said[0].startswith("gradient noise scale B_simple ~ 112 items per step")
    assert said[1].startswith("a smaller batch (--effective-batch 28, about B_simple)")
    # each figure once, with what it counts: fewer samples, then more optimizer steps
    assert " would reach the same loss on about " in said[1] and said[1].count("same loss") == 1
    assert said[1].count("fewer samples") == 1 and said[1].count("more optimizer steps") == 1
    short = noise_advice(256, NoiseReading(112.0, 80.0, 160.0, 20, 0.9), 4.0)
    assert "--effective-batch" not in short and "advice waits for 50" in short


def test_the_plan_says_the_whole_run_phase_by_phase_and_every_number_in_words(tmp_path):
    """plan.json's phases were a raw JSON dump and "batch bytes 131,072" went unexplained; the
    configuration was 40 rows, many null: now what differs from the defaults, the rest folded."""
    run = tmp_path / "run"
    run.mkdir()
    config = {**_defaults_of("gpt"), "budget": "200MB", "effective_batch": 128}
    (run / "config.json").write_text(json.dumps(config))
    plan = {
        "effective_batch": 128, "world_size": 1, "micro_size": 16, "micro_batches": 8,
        "last_micro_size": 16, "micro_sizes": [16] * 8, "largest_fitting": 18,
        "predicted_peak": 150 * 2**20, "batch_bytes": 131_072, "source": "planned",
        "checkpointing": False, "checkpointed_blocks": [],
        "phases": [
            {"name": "evaluation", "micro_size": 16, "peak_bytes": 40 * 2**20, "tried": []},
            {"name": "checkpoint", "micro_size": 16, "peak_bytes": 30 * 2**20, "tried": []},
        ],
    }  # fmt: skip
    (run / "plan.json").write_text(json.dumps(plan))
    page = render(run)
    rows = Page(page).rows
    assert ["effective batch", "128 samples = 8 x 16"] in rows, rows
    # not the line's largest (18): a fresh process may refuse it; the plan's own reason
    assert ["micro-batch", "16 samples; planned: measured"] in rows
    assert "18" not in "".join(r[1] for r in rows if r[0] == "micro-batch")
    assert ["the window's input batch (held while it trains)", "128.0 KiB"] in rows
    assert ["phase of the run", "micro-batch", "peak, measured", ""] in rows
    assert ["training", "16", "150.0 MiB", "the most"] in rows
    assert ["evaluation", "16", "40.0 MiB", ""] in rows
    assert "131,072" not in page and '"peak_bytes"' not in page and "batch bytes" not in page
    # the configuration: the two options set, then the rest folded
    section = page[page.index('id="config"') :]
    shown, folded = section.split("<details>")
    assert Page(shown).rows == [["effective_batch", "128"], ["budget", "200MB"]]
    assert f"the other {len(config) - 2} options, at their defaults" in folded


def _defaults_of(recipe):
    from gradaccum.app.config import TrainConfig

    return TrainConfig.of(recipe=recipe).flat()


def test_batch_png_is_in_samples_and_its_interval_cut_to_what_the_readings_support(tmp_path):
    """The demo's plot drew B_simple at 24,175 items with a band from 0 to 37,889 on a log
    axis while the advice said 29 samples: B_simple is drawn in samples (items over the
    window's items per sample), a reading whose interval reaches zero is a gap, and the band
    stops at 10x the batch."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    from gradaccum.app.report.plots import batch_plot

    axes = []

    class Kept:
        def subplots(self, **kw):
            fig, ax = pyplot.subplots(**kw)
            axes.append(ax)
            return fig, ax

        def close(self, fig):
            pyplot.close(fig)

    noise = [(24174.8, 0.0, 37888.8), (3717.5, 2364.7, 5876.1), (3000.0, 1000.0, 900_000.0)]
    lines = [
        {"step": i + 1, "samples": 64 * (i + 1), "count": 8128, "effective_batch": 64,
         "noise_scale": b, "noise_low": lo, "noise_high": hi}
        for i, (b, lo, hi) in enumerate(noise)
    ]  # fmt: skip
    batch_plot(Kept(), tmp_path, lines)
    (ax,) = axes
    [b_simple] = [line for line in ax.lines if line.get_label() == "B_simple"]
    ys = list(b_simple.get_ydata())
    assert math.isnan(ys[0])  # its interval reaches zero: nothing to draw
    assert ys[1] == pytest.approx(3717.5 * 64 / 8128)  # 29.3 samples, as the advice says
    low, high = ax.get_ylim()
    assert high == 640  # 10x the batch of 64
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "its 90% interval (cut at 10x the batch)" in labels
    assert ax.get_ylabel() == "samples per step"


def test_the_noise_advice_keeps_its_lines_on_the_page(tmp_path):
    """The console prints the measurement, then the advice, each on its line; the page ran
    them together ("... is 8,128 items a smaller batch ...")."""
    from gradaccum.app.report.summary import noise_advice
    from gradaccum.noise import NoiseReading

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "gpt", "effective_batch": 64}))
    said = noise_advice(8128, NoiseReading(3717.5, 2364.7, 5876.1, 75, 0.9), 127.0)
    assert said.count("\n") == 1  # two lines, as the console prints them
    (run / "summary.json").write_text(json.dumps({"steps": 150, "noise_advice": said}))
    page = render(run)
    cells = [c for c in re.findall(r"<td([^>]*)>([^<]*)</td>", page) if c[1] == html.escape(said)]
    assert cells == [(' class="lines"', html.escape(said))], cells
    assert re.search(r"\.lines\{white-space:pre-line\}", Page(page).style)


def _full_plan():
    """A Plan with every field filled as the timing race fills it: timings with unrounded
    seconds and a fractional peak, phases with a tried size, a choice and its seconds."""
    import dataclasses

    from helpers import make_plan

    from gradaccum.planning import Fit, Phase, Probe
    from gradaccum.planning.speed import Timing

    mib = 2**20
    line = Fit(intercept=20 * mib, slope=4 * mib, max_error=0.3)
    timings = (
        Timing(16, 4, 16, 16, (14.578669672000615, 4.29237818799993, 3.5027620119999483),
               160338944.0),
        Timing(8, 8, 8, 16, (3.138939812000899, 4.011222868000914), 96161818.71304348),
        Timing(4, 16, 4, 16, (5.7409078479995514,), 64073256.06956523, left=4, checkpointed=True),
    )  # fmt: skip
    return dataclasses.replace(
        make_plan(64, micro=16, checkpointing=True),
        budget=200_000_000,
        static_bytes=10 * mib,
        overhead_bytes=10 * mib,
        batch_bytes=131_072,
        predicted_peak=152.9 * mib,
        peak_fit=line,
        activation_fit=line,
        bytes_per_sample=4.123456789 * mib,
        largest_fitting=18,
        probes=(
            Probe(4, 30 * mib, mib, line(4)),
            Probe(16, 113 * mib, mib, line(16) + 0.123456, kind="verify, fresh process"),
        ),
        seconds=98.41234567,
        notes=("note: something the planner said",),
        phases=(Phase("evaluation", 16, 47519004, ((32, 300_000_000),)),),
        prefer="fastest",
        timings=timings,
        choice="the largest that fits; timing cannot tell it from 8 beyond the noise",
        timing_seconds=34.03243500299959,
    )


def test_no_plan_field_reaches_the_page_as_raw_json_or_an_unrounded_float(tmp_path):
    """Issue 47: the timing race's fields were a raw JSON row (`timings | [{"micro_size": 16,
    ..., "seconds": [14.578669672000615, ...]`) and `timing seconds | 34.03243500299959`."""
    from gradaccum.planning.result import TIMING_HEAD, format_seconds

    plan = _full_plan()
    saved = plan.to_dict()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "gpt", "effective_batch": 64}))
    (run / "plan.json").write_text(json.dumps(saved))
    page = render(run)
    section = page[page.index('id="plan"') : page.index('id="config"')]
    cells = [c for r in Page(section).rows for c in r]
    print("\n".join(" | ".join(r) for r in Page(section).rows))
    for cell in cells:
        # JSON's braces, quotes or lists of objects, a float's raw digits, an uncommaed count
        assert not re.search(r'[{}"]|\[\s*[\[{]|\d\.\d{5,}|\d{5,}', cell), cell
    # the timings as the console's table, every cell its cell
    rows = Page(section).rows
    assert list(TIMING_HEAD) in rows
    for row in plan.timing_rows():
        assert row in rows, row
    assert ["4", "16 x 4", "on", "61.1 MiB", "5.74 [5.74, 5.74]", "89.7", "1",
            "left the race after round 4: slower"] in rows  # fmt: skip
    # the planning time as the console says it, the timing's share folded in
    took = f"{format_seconds(98.41234567)} (the timing took 34.0 s of the 1 min 38 s)"
    assert ["planning took", took] in rows and "planned in 1 min 38 s" in plan.summary()
    # one micro-batch number: the plan's reason, as the summary says it, not the line's 18
    micro = next(r[1] for r in rows if r[0] == "micro-batch")
    assert micro.startswith(f"16 samples ({plan.reason()})") and "18" not in micro
    assert f"micro-batch 16 ({plan.reason()})" in plan.summary()
    # every Plan field said somewhere: none shown under its raw name
    assert not {"timings", "timing seconds", "choice", "prefer"} & {r[0] for r in rows}


def test_the_page_leaves_out_the_trade_off_the_console_leaves_out(run):
    summary = json.loads((run / "summary.json").read_text())
    said = "against a batch of one sample (127 items), this batch should take about 218% more"
    summary["noise_tradeoff"] = said
    (run / "summary.json").write_text(json.dumps(summary))
    page = render(run)
    assert "trade-off" not in page and said not in page


def test_a_resume_says_how_the_session_before_it_ended(run):
    """After a stop on SIGINT the Resumes row said 'what changed: nothing' (issue 58)."""
    from gradaccum.app.build import previous_stop
    from gradaccum.app.folder import RunFolder

    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "stopped_by": "signal"}))
    after = previous_stop(RunFolder(run))
    assert after == "a stop signal (checkpointed)"
    (run / "resumes.jsonl").write_text(json.dumps({"step": 4, "changed": {}, "after": after}))
    page = Page(render(run))
    assert ["4", "after: a stop signal (checkpointed)\nno setting"] in page.rows, page.rows
