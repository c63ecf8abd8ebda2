"""The asv history pages under results/asv/html (written by `nox -s asv`) render in a real headless
browser and list the perf/asv benchmarks."""

import functools
import http.server
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "results" / "asv" / "html"
BENCHMARKS = ("throughput.Throughput.track_tokens_per_s", "throughput.Kernels.track_tokens_per_s")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run")


@pytest.fixture
def served_pages():
    """The pages over HTTP on a free local port (asv's pages load their data with XHR, which file:// forbids)."""
    assert (HTML / "index.html").is_file(), f"no published asv pages at {HTML}; run `nox -s asv`"
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    server.shutdown()
    server.server_close()


def test_published_asv_pages_list_the_benchmarks(served_pages, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed; `nox -s pages` installs it (apt-get install -y chromium)"
    dom = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000",
         "--dump-dom", served_pages],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert "airspeed velocity" in dom.lower(), "the page did not render"
    for name in BENCHMARKS:
        assert name in dom, f"benchmark {name} is not listed on the rendered page"
