"""``report.html`` beside ``results.md`` (``fedlowrank compare`` and ``benchmarks/protocols.py``): one
self-contained page (nothing fetched: the plots and the label histogram inline as PNG data) holding the setup, the
table, the paired statistics and the exact command, which Debian's headless Chromium renders with every image
and no console message."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import benchmark_module

from fedlowrank.cli import main
from fedlowrank.reporting.html import markdown_html

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
# appended to a copy of the page: once it has loaded, the body says which images decoded (1) and which did not (0)
IMAGES_LOADED = ('<script>window.addEventListener("load", () => {document.body.dataset.images = [...document.images]'
                 '.map(i => i.complete && i.naturalWidth > 0 ? 1 : 0).join(",")})</script>')
COMMAND = ["compare", "tiny", "--methods", "fedalt,fedlease", "--seeds", "0,1", "--quiet"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out"
    assert main([*COMMAND, "--out", str(out)]) == 0
    return out


def test_the_page_holds_the_results_plots_histogram_and_command(compared):
    page = (compared / "report.html").read_text()
    results = json.loads((compared / "results.json").read_text())
    assert results["command"] == "fedlowrank " + " ".join([*COMMAND[:-1], "--quiet", "--out", str(compared)])
    assert f"<pre>{results['command']}</pre>" in page
    assert "<h2>Paired differences against fedalt</h2>" in page and "<th>signed-rank p</th>" in page
    assert page.count("<td>fedlease</td>") >= 1 and "BBC News" in page
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page)
    assert captions == ["accuracy vs round", "accuracy vs bytes",
                        "labels per client, seed 0 (the same partition for every method)"]
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == 3 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r"https?://|<link|<script", page)  # nothing to fetch, nothing to run
    assert "report.html" in json.loads((compared / ".fedlowrank-run").read_text())["own"]


def test_the_markdown_subset_is_rendered_and_escaped():
    html = markdown_html("# T\n\n- a `x<y`\n- b\n\n| h | k |\n|---|---|\n| 1 \\| 2 | <b> |\n\npara\nline")
    assert html == ("<h1>T</h1>\n<ul><li>a <code>x&lt;y</code></li><li>b</li></ul>\n<table><thead><tr><th>h</th>"
                    "<th>k</th></tr></thead><tbody><tr><td>1 | 2</td><td>&lt;b&gt;</td></tr></tbody></table>\n"
                    "<p>para line</p>")


def render(page: Path, profile: Path) -> tuple[str, str]:
    """``(the DOM after load, Chromium's log)`` of ``page`` in headless Chromium with a fresh profile."""
    proc = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=5000", "--dump-dom", page.as_uri()], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_chromium_renders_every_image_without_a_console_message(compared, tmp_path):
    checked = tmp_path / "report.html"
    checked.write_text((compared / "report.html").read_text().replace("</body>", IMAGES_LOADED + "</body>"))
    dom, log = render(checked, tmp_path / "profile")
    assert re.search(r'data-images="1,1,1"', dom), re.findall(r"data-images=\"[^\"]*\"", dom)
    assert "CONSOLE" not in log, [line for line in log.splitlines() if "CONSOLE" in line]
    broken = tmp_path / "broken.html"  # the check sees a missing image and a console message
    broken.write_text(checked.read_text().replace("<h2>Command</h2>", '<img src="missing.png"><script>'
                                                  'console.error("boom")</script><h2>Command</h2>'))
    dom, log = render(broken, tmp_path / "profile2")
    assert 'data-images="1,1,1,0"' in dom and "CONSOLE" in log


def test_a_protocol_read_against_another_reference_writes_its_page_too(compared, tmp_path):
    protocols = benchmark_module("protocols")
    done = tmp_path / "fedalt-tasks" / "compare"
    done.mkdir(parents=True)
    shutil.copy(compared / "results.json", done / "results.json")
    command = "python benchmarks/protocols.py fedlease-tasks --out " + str(tmp_path)
    results = protocols.read_against_reference("fedlease-tasks", tmp_path, "cpu", None, command)
    page = (tmp_path / "fedlease-tasks" / "report.html").read_text()
    assert results["reference"] == "fedlease" and "<h2>Paired differences against fedlease</h2>" in page
    assert f"<pre>{command}</pre>" in page and len(re.findall(r'src="data:image/png;base64,', page)) == 3
