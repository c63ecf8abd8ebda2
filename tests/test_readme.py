"""The README: its first screen says what the tool is, how to set it up and how to point it at one's own engine,
and every example output in it is what the current code prints (tools/readme_examples.py --check)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_SCREEN = 45  # lines


def test_first_screen_has_the_tool_the_two_commands_and_your_engine():
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN])
    assert "bit for bit" in first and "## Set-up: two commands" in first
    assert "pip install torch==2.13.0 -e . && logdiff run" in first and "nox -s lint tests" in first
    assert "## Point it at your engine" in first and "--stack my_module:my_factory" in first and "--stack vllm" in first
    assert "chromium" in first  # what the tests install, and where


def test_every_example_output_is_what_the_current_code_prints():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_examples.py"), "--check"], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
