"""The run report in a real browser: a screenshot, and the browser's own network log as proof
that the page asks for nothing but itself.

Trains a short run of the digits recipe in-process (or takes an existing RUN_DIR), writes its
report page into an otherwise empty folder (so anything it referenced beside itself would be
missing), and renders it with Debian's Chromium (`apt-get install chromium`), each time with a
new profile and a net log (--log-net-log):

1. the page as written: the screenshot, results/report.png;
2. the page with its Content-Security-Policy line removed: the policy blocks fetches before
   they reach the network log, so only without it does the log show that the page's own
   content asks for nothing;
3. a control page that asks for two external images: its log must show both requests, or
   the check could not see a request and would prove nothing.

A render passes when its log has no URL request to anything but the page itself (no http,
https, ws or other URL; data: and an empty, invalid URL are not network addresses) and no
socket or DNS lookup at all. Chromium's own background requests (network time, the AI mode
eligibility check, the search preconnect, the Google account check) are turned off by the
flags in QUIET, each named; a new Chromium that adds one shows up here as a failure.

    python bench/report_screenshot.py [RUN_DIR]

Writes results/report.png and results/report.md; exits 1 when a check fails. Without
Chromium it says so and exits 0, leaving the committed results as they are.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import torch  # noqa: E402

from gradaccum.app import TrainConfig, train  # noqa: E402
from gradaccum.app.report import write_report  # noqa: E402

# The test suite's fault injection (tests/support/faults.py), which the package does not ship.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.faults import corrupt_samples, train_with_faults  # noqa: E402

torch.set_num_threads(1)

OUT = Path(__file__).parent / "results"
CHROMIUM = "/usr/bin/chromium"
WINDOW = (1200, 2400)
BASE = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Chromium's own requests that the flags above leave on, seen in this script's net logs.
QUIET = [
    # clients2.google.com/time (network time), www.google.com/async/folae (AI mode
    # eligibility) and the preconnect to the default search engine (www.google.com)
    "--disable-features=NetworkTimeServiceQuerying,AimEnabled,PreconnectToSearch",
    # accounts.google.com/ListAccounts (the browser's account check) has no off switch; its
    # URL is pointed at an invalid one, so the attempt fails inside the browser
    '--gaia-config-contents={"urls":{"list_accounts_url":{"url":"data:,"}}}',
]
# Net-log sources that mean the network was used: sockets, name lookups, connections. (The
# QUIC session pool's housekeeping is logged on every run and is not among them.)
NETWORK_SOURCES = ("SOCKET", "HOST_RESOLVER", "DNS_TRANSACTION", "CONNECT_JOB", "HTTP_STREAM")
CONTROL_URLS = ("http://127.0.0.1:9/control.png", "https://example.invalid/bg.png")
CONTROL = (
    "<!DOCTYPE html><html><body><p>control</p>"
    f'<img src="{CONTROL_URLS[0]}" alt="">'
    f'<div style="background:url({CONTROL_URLS[1]})">x</div></body></html>'
)


def make_run(folder: Path) -> Path:
    """A short digits run whose window 25 has its labels corrupted (the guard rolls it back),
    then resumed with an accuracy target it meets: every file a run folder holds today
    (metrics, summary, plots, plan, resumes, incidents, targets)."""
    run = folder / "digits-report"
    quiet = lambda *a, **k: None  # noqa: E731
    cfg = dict(recipe="digits", micro_batch=16, effective_batch=64, eval_every=10)
    bad = corrupt_samples([(24 * 64, 25 * 64)])
    first = TrainConfig.of(**cfg, steps=40, checkpoint_every=10, out=str(run))
    train_with_faults(first, bad, quiet)
    again = TrainConfig.of(
        **cfg, steps=100, checkpoint_every=10, target_accuracy=0.98, out=str(run), resume=str(run)
    )
    train(again, log=quiet)
    return run


def chromium(page: Path, profile: Path, netlog: Path, screenshot: Path) -> list[str]:
    return [
        CHROMIUM,
        *BASE,
        *QUIET,
        f"--user-data-dir={profile}",
        "--hide-scrollbars",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        f"--screenshot={screenshot}",
        f"--log-net-log={netlog}",
        page.as_uri(),
    ]


def render(page: Path, work: Path, tag: str) -> tuple[list[str], Path, dict]:
    profile = Path(tempfile.mkdtemp(prefix=f"profile-{tag}-", dir=work))
    netlog, shot = work / f"{tag}.netlog.json", work / f"{tag}.png"
    cmd = chromium(page, profile, netlog, shot)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not shot.is_file():
        sys.exit(f"chromium failed on {page} (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return cmd, shot, read_netlog(netlog)


def read_netlog(file: Path) -> dict:
    text = file.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a browser that exits abruptly leaves the list open
        return json.loads(text.rstrip().rstrip(",") + "]}")


def verdict(log: dict, page: Path) -> dict:
    """What the net log shows: each URL request (its URL and how it ended), every other URL
    the log names, the events of network sources by kind, and the problems: any URL but the
    page itself, data: or the empty (invalid) one, and any network event at all."""
    sources = {v: k for k, v in log["constants"]["logSourceType"].items()}
    requests: dict[int, dict] = {}
    urls: set[str] = set()
    network: dict[str, int] = {}
    for e in log["events"]:
        source = sources.get(e["source"]["type"], "?")
        params = e.get("params") or {}
        if any(s in source for s in NETWORK_SOURCES) or source == "QUIC_SESSION":
            network[source] = network.get(source, 0) + 1
        if source == "URL_REQUEST":
            r = requests.setdefault(e["source"]["id"], {"url": None, "net_error": None})
            if isinstance(params.get("url"), str) and r["url"] is None:
                r["url"] = params["url"]
            if "net_error" in params:
                r["net_error"] = params["net_error"]
        for key, value in params.items():
            if (key == "url" or key.endswith("_url")) and isinstance(value, str):
                urls.add(value)
    allowed = {"", page.as_uri()}
    bad = sorted(u for u in urls if u not in allowed and not u.startswith("data:"))
    bad += [f"{n} {source} events" for source, n in sorted(network.items())]
    return {"requests": list(requests.values()), "urls": sorted(urls), "bad": bad}


def describe_requests(v: dict) -> str:
    if not v["requests"]:
        return "no URL request"
    return "; ".join(
        f"a URL request to {r['url']!r}"
        + ("" if r["net_error"] is None else f" that ended with net error {r['net_error']}")
        for r in v["requests"]
    )


def static_refs(text: str) -> list[str]:
    """References in the page's markup to anything but data: URIs and #anchors."""
    refs = re.findall(r"""(?:src|href|action|poster|data)\s*=\s*["']([^"']*)""", text)
    refs += re.findall(r"""url\(\s*['"]?([^'")]*)""", text)
    return [r for r in refs if not (r.startswith("data:") or r.startswith("#"))]


def main() -> int:
    if not Path(CHROMIUM).is_file():
        print(f"skipped: no {CHROMIUM} (apt-get install chromium); results left as they are")
        return 0
    version = subprocess.run(
        [CHROMIUM, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run = Path(sys.argv[1]) if len(sys.argv) > 1 else make_run(work)
        alone = work / "alone"
        alone.mkdir()
        page = write_report(run, alone / "report.html")
        text = page.read_text()
        no_csp = alone / "report-no-csp.html"
        no_csp.write_text(re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>\n?', "", text))
        if "Content-Security-Policy" in no_csp.read_text():
            sys.exit("could not remove the page's Content-Security-Policy line")
        control = alone / "control.html"
        control.write_text(CONTROL)
        cmd, shot, log = render(page, work, "page")
        checks = {"page": verdict(log, page)}
        checks["no-csp"] = verdict(render(no_csp, work, "no-csp")[2], no_csp)
        checks["control"] = verdict(render(control, work, "control")[2], control)
        OUT.mkdir(exist_ok=True)
        shutil.copyfile(shot, OUT / "report.png")

    missed = [u for u in CONTROL_URLS if u not in checks["control"]["bad"]]
    refs = static_refs(text)
    images = text.count('<img src="data:image/png;base64,')
    ok = not checks["page"]["bad"] and not checks["no-csp"]["bad"] and not missed and not refs
    print(version)
    for name, v in checks.items():
        print(f"{name}: {describe_requests(v)}")
        print(f"{name}: every URL the net log names: {v['urls'] or 'none'}")
        print(f"{name}: beyond the page: {v['bad'] or 'none'}")
    print(f"control: its external URLs the check missed: {missed or 'none'}")
    print(f"markup references other than data: and #anchors: {refs or 'none'}")
    print(f"verdict: {'PASS' if ok else 'FAIL'}")
    write_md(version, cmd, run, images, len(text), checks, missed, refs, ok)
    return 0 if ok else 1


def write_md(version, cmd, run, images, size, checks, missed, refs, ok) -> None:
    placeholders = {
        "--user-data-dir=": "--user-data-dir=NEW_TEMP_DIR",
        "--screenshot=": "--screenshot=report.png",
        "--log-net-log=": "--log-net-log=netlog.json",
        "file:": "file:///.../report.html",
    }
    shown = [next((v for k, v in placeholders.items() if c.startswith(k)), c) for c in cmd]
    what = (
        "a digits run trained by this script (optimizer steps of 64 images in micro-batches "
        "of 16; window 25's labels corrupted, so the guard rolls back once; 40 steps, then "
        "resumed with --target-accuracy 0.98 and --steps 100, so the page has an incident, a "
        "resume and a target)"
        if len(sys.argv) <= 1
        else f"the run folder {Path(run).name}"
    )
    page, no_csp, control = checks["page"], checks["no-csp"], checks["control"]
    network = [b for b in control["bad"] if b.endswith(" events")]
    lines = [
        "# The run report in a browser",
        "",
        f"`bench/report_screenshot.py`: the page `gradaccum report` writes for {what}, written "
        f"alone into an empty folder ({size:,} characters, {images} plots embedded as data: "
        "URIs) and rendered by headless Chromium with a new profile and a net log.",
        "",
        f"- Browser: {version}",
        f"- Verdict: **{'PASS' if ok else 'FAIL'}**",
        f"- The page: {describe_requests(page)}; beyond the page: "
        + ("nothing" if not page["bad"] else "; ".join(page["bad"])),
        f"- The page without its Content-Security-Policy: {describe_requests(no_csp)}; beyond "
        "the page: " + ("nothing" if not no_csp["bad"] else "; ".join(no_csp["bad"])),
        "- The control page (two external images): the log shows "
        + ", ".join(f"`{u}`" for u in CONTROL_URLS if u not in missed)
        + (f", and misses {missed}" if missed else "")
        + f", with {sum(int(b.split()[0]) for b in network)} socket, lookup and connection "
        "events: the check sees a page's requests",
        "- References in the markup other than `data:` and `#anchors`: "
        + ("none" if not refs else ", ".join(refs)),
        "",
        (
            "The one URL request in the page's logs is Chromium's own Google account check: "
            "`--gaia-config-contents` points it at an invalid URL, so it fails inside the "
            "browser (net error -300, ERR_INVALID_URL) without a socket or a name lookup. "
            if page["requests"] == [{"url": "", "net_error": -300}]
            else ""
        )
        + "The "
        "`--disable-features` flag turns off Chromium's other background requests (network "
        "time, the AI mode eligibility check, the search preconnect); without these two flags "
        "its net log names google.com addresses whatever page it shows.",
        "",
        "![the report page](report.png)",
        "",
        "Command (the screenshot; the other two renders differ only in the page, the profile "
        "and the log):",
        "",
        "```",
        shlex.join(shown),
        "```",
        "",
    ]
    (OUT / "report.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
