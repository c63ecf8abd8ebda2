"""Running the conformance catalogue in-process and summarising it: a verdict per property, the
result files of `logdiff check` (check.json, check.md, conformance.svg, logdiff.svg)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from logdiff import remote, report
from logdiff.report import progress

from . import CATALOGUE, property_of
from .plugin import pytest_report_header, stack_info

RESULT_FILES = ("check.json", "check.md", "conformance.svg", "logdiff.svg")


def run_catalogue(stack: str, selected: list[str], xfails_file: str | None, options: list[str] = ()) -> Collector:
    """The catalogue's tests of the `selected` properties on `stack`, in this process, one progress line per test."""
    import pytest

    # pytest's own terminal output gives way to the progress lines and the table; addopts (-ra) need it.
    pytest_args = [str(Path(__file__).parent), f"--stack={stack}", "-p", "no:cacheprovider",
                   "-p", "no:terminal", "-o", "addopts=", *options]
    if xfails_file:
        pytest_args.append(f"--xfails-file={xfails_file}")
    if selected != list(CATALOGUE):
        pytest_args += ["-k", " or ".join(f"test_c{p[1:]}_" for p in selected)]
    collector = Collector()
    progress(f"logdiff check: stack {stack}, properties {', '.join(selected)}")
    code = pytest.main(pytest_args, plugins=[collector])
    if code == pytest.ExitCode.INTERRUPTED:
        raise KeyboardInterrupt
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or collector.errors:
        raise RuntimeError(f"the conformance run did not complete (pytest exit {int(code)}): {'; '.join(collector.errors)}")
    return collector



@dataclass
class TestResult:
    id: str
    property: str
    outcome: str | None = None  # pass, fail, xfail, xpass, skipped
    seconds: float = 0.0
    message: str = ""
    compared: list = field(default_factory=list)  # bitwise comparisons: what, values, bitwise_equal, max_abs_diff
    fidelity: list = field(default_factory=list)  # C0: each side's distance from the fp64 oracle, and sampling fits
    engine_starts: list = field(default_factory=list)  # seconds of each engine process started (logdiff.remote)


class Collector:
    """A pytest plugin: one TestResult per test, from its setup/call/teardown reports, and a progress line."""

    def __init__(self):
        self.by_id: dict[str, TestResult] = {}
        self.errors: list[str] = []
        self.header: list[str] = []
        self.stack_info: dict = {}
        self.total = 0
        self._starts_before = 0

    @property
    def results(self) -> list[TestResult]:
        return list(self.by_id.values())

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(f"cannot collect {report.nodeid}: {report.longreprtext.strip().splitlines()[-1]}")

    def pytest_collection_finish(self, session):

        self.total = len(session.items)
        self.header = pytest_report_header(session.config)
        self.stack_info = stack_info(session.config)
        for line in self.header:
            progress(line)
        progress(f"{self.total} tests")

    def pytest_warning_recorded(self, warning_message, when, nodeid, location):
        import pytest

        if isinstance(warning_message.message, pytest.PytestWarning):  # e.g. an xfails line naming no test
            progress(f"warning: {warning_message.message}")

    def pytest_runtest_logstart(self, nodeid, location):
        self._starts_before = len(remote.START_SECONDS)

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        result = self.by_id.setdefault(report.nodeid, TestResult(name, property_of(name) or "?"))
        result.seconds += report.duration
        result.compared += [v for k, v in report.user_properties if k == "compared" and v not in result.compared]
        result.fidelity += [v for k, v in report.user_properties if k in ("fidelity", "sampling") and v not in result.fidelity]
        outcome = _outcome(report)
        if outcome == "fail" or (outcome and result.outcome is None):
            result.outcome, result.message = outcome, ("" if outcome == "pass" else _message(report))
        if report.when == "teardown":
            result.outcome = result.outcome or "pass"
            result.engine_starts = remote.START_SECONDS[self._starts_before:]
            starts = result.engine_starts
            started = f", {len(starts)} engine start{'s' * (len(starts) > 1)} {sum(starts):.1f}s" if starts else ""
            progress(f"[{len(self.by_id):>3}/{self.total}] {result.property:<4} {name}: {result.outcome} "
                     f"({result.seconds:.1f}s{started})")


def _outcome(report) -> str | None:
    """The outcome a report decides, or None (a setup or teardown that went fine)."""
    if hasattr(report, "wasxfail"):
        return "xfail" if report.skipped else "xpass"
    if report.skipped:
        return "skipped"
    if report.failed:
        return "fail"
    return "pass" if report.when == "call" else None


def _message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: reason")
        return longrepr[2].removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash else str(longrepr or getattr(report, "wasxfail", ""))
    where = "" if report.when == "call" else f"error in {report.when}: "
    return where + re.sub(r"^[\w.]*(PropertyViolation|AssertionError|DistinctFailures): ", "", text)


# --------------------------------------------------------------------------- verdicts and files


def summarise(results: list[TestResult], selected: list[str], catalogue: dict) -> dict[str, dict]:
    """Per property: counts per outcome, the verdict (fail > xfail > pass > skipped) and max |diff|."""
    out = {}
    for pid in selected:
        tests = [r for r in results if r.property == pid]
        counts = {o: sum(r.outcome == o for r in tests) for o in ("pass", "fail", "xfail", "xpass", "skipped")}
        if counts["fail"]:
            verdict = "fail"
        elif counts["xfail"]:
            verdict = "xfail"
        elif counts["pass"] or counts["xpass"]:
            verdict = "pass"
        else:
            verdict = "skipped"
        diffs = [c["max_abs_diff"] for r in tests for c in r.compared]
        diffs += [f["max_abs_error"] for r in tests for f in r.fidelity if "max_abs_error" in f]
        out[pid] = {"meaning": catalogue[pid], "tests": len(tests), **counts, "verdict": verdict,
                    "max_abs_diff": max(diffs) if diffs else None}
    return out


def overall_verdict(verdicts: dict[str, dict]) -> str:
    """fail if a property fails; pass only if every property passes; partial if some were skipped or xfailed."""
    found = {v["verdict"] for v in verdicts.values()}
    return "fail" if "fail" in found else "pass" if found == {"pass"} else "partial"


def max_abs_logdiff(results: list[TestResult]) -> float | None:
    diffs = [c["max_abs_diff"] for r in results for c in r.compared if c["what"] == "rollout vs trainer"]
    return max(diffs) if diffs else None


def fidelity_by_side(results: list[TestResult]) -> dict[str, float]:
    """C0: the largest |logp - logp_fp64| of each side (rollout, trainer, prompt) over the catalogue."""
    out: dict[str, float] = {}
    for f in (f for r in results for f in r.fidelity if "side" in f):
        out[f["side"]] = max(out.get(f["side"], 0.0), f["max_abs_error"])
    return out


def table_rows(verdicts: dict[str, dict]) -> list[dict]:
    return [
        {"property": pid, "what": v["meaning"].split(":")[0], "tests": v["tests"], "pass": v["pass"] + v["xpass"],
         "fail": v["fail"], "xfail": v["xfail"], "skipped": v["skipped"], "verdict": v["verdict"],
         "max abs diff": "-" if v["max_abs_diff"] is None else report.fmt_float(v["max_abs_diff"])}
        for pid, v in verdicts.items()
    ]


def badges(verdicts: dict[str, dict], logdiff: float | None) -> dict[str, str]:
    import anybadge

    counts = {o: sum(v["verdict"] == o for v in verdicts.values()) for o in ("pass", "fail", "xfail", "skipped")}
    value = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
    color = "red" if counts["fail"] else "yellowgreen" if counts["xfail"] or counts["skipped"] else "green"
    if logdiff is None:
        logdiff_value, logdiff_color = "n/a", "lightgrey"
    else:
        logdiff_value, logdiff_color = report.fmt_float(logdiff), "green" if logdiff == 0 else "red"
    return {
        "conformance.svg": anybadge.Badge("conformance", value, default_color=color).badge_svg_text,
        "logdiff.svg": anybadge.Badge("max |logdiff|", logdiff_value, default_color=logdiff_color).badge_svg_text,
    }


def markdown(stack: str, header: list[str], rows: list[dict], results: list[TestResult]) -> str:
    lines = [f"# logdiff check: `{stack}`", "", *[f"    {h}" for h in header], "", report.table(rows, fmt="github"), ""]
    for title, outcome in (("Failures", "fail"), ("Known gaps (xfail)", "xfail"), ("Skipped", "skipped")):
        listed = [r for r in results if r.outcome == outcome]
        if listed:
            lines += [f"## {title}", ""]
            lines += [f"- `{r.id}`: " + r.message.replace("\n", "; ") for r in listed]
            lines.append("")
    return "\n".join(lines)


def write_results(out: Path, envelope: dict, header, rows, results, entry) -> None:
    report.write_json(out / "check.json", envelope)
    report.write_text(out / "check.md", markdown(entry["name"], header, rows, results))
    for name, svg in badges(entry["properties"], entry["max_abs_logdiff"]).items():
        report.write_text(out / name, svg)
