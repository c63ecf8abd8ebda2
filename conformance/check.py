"""Running the conformance catalogue in-process and summarising it: a verdict per property, the
result files of `logdiff check` (check.json, check.md, conformance.svg, logdiff.svg)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from logdiff import remote, report
from logdiff.errors import UserError
from logdiff.report import progress

from . import CATALOGUE, property_of
from .plugin import pytest_report_header, stack_info

RESULT_FILES = ("check.json", "check.md", "conformance.svg", "logdiff.svg")


def run_catalogue(stack: str, selected: list[str], xfails_file: str | None, options: list[str] = (),
                  keyword: str | None = None) -> Collector:
    """The catalogue's tests of the `selected` properties on `stack` (and matching pytest's -k `keyword`), in this
    process, one progress line per test."""
    # pytest's own terminal output gives way to the progress lines and the table; addopts (-ra) need it.
    pytest_args = [str(Path(__file__).parent), f"--stack={stack}", "--import-mode=importlib", "-p", "no:cacheprovider",
                   "-p", "no:terminal", "-o", "addopts=", *options]
    if xfails_file:
        pytest_args.append(f"--xfails-file={xfails_file}")
    keywords = [] if selected == list(CATALOGUE) else [" or ".join(f"test_c{p[1:]}_" for p in selected)]
    keywords += [keyword] if keyword else []
    if keywords:
        pytest_args += ["-k", " and ".join(f"({k})" for k in keywords)]
    collector = Collector()
    progress(f"logdiff check: stack {stack}, properties {', '.join(selected)}" + (f", -k {keyword}" if keyword else ""))
    code = pytest.main(pytest_args, plugins=[collector])
    if code == pytest.ExitCode.INTERRUPTED:
        raise KeyboardInterrupt
    if code == pytest.ExitCode.USAGE_ERROR and keyword:
        raise UserError(f"-k {keyword!r} is not a pytest -k expression; pass a test id as a failure prints it, "
                        "e.g. -k 'test_c3_rollout_matches_trainer[dense]'")
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        raise UserError(f"no test of {', '.join(selected)} matches -k {keyword!r}; the test ids are in check.md, "
                        "or pass a name such as test_c3_rollout_matches_trainer")
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or collector.errors:
        # Not a verdict on the stack: the check itself could not run (exit 2, which a CI gate tells from a failure).
        raise UserError(f"the conformance run did not complete (pytest exit {int(code)}: {'; '.join(collector.errors)}); "
                        f"run `pytest --pyargs logdiff.conformance --stack {stack}` to see pytest's own report")
    return collector



@dataclass
class TestResult:
    id: str
    property: str
    outcome: str | None = None  # pass, fail, xfail, xpass, skipped
    failure: str = ""  # of a fail: "differ" (the property does not hold: bits differ, C0 bound exceeded) or "error"
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
        self.started = time.monotonic()
        self.header = pytest_report_header(session.config)
        self.stack_info = stack_info(session.config)
        for line in self.header:
            progress(line)
        progress(f"{self.total} tests")

    def pytest_warning_recorded(self, warning_message, when, nodeid, location):
        if isinstance(warning_message.message, pytest.PytestWarning):  # e.g. an xfails line naming no test
            progress(f"warning: {warning_message.message}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        # A property that does not hold raises an AssertionError (PropertyViolation, DistinctFailures); anything
        # else is the stack or its engine erring, which is not a bit difference and is counted apart.
        if report.failed and call.excinfo is not None:
            report.logdiff_failure = "differ" if call.excinfo.errisinstance(AssertionError) else "error"
        return report

    def pytest_runtest_logstart(self, nodeid, location):
        self._starts_before = len(remote.START_SECONDS)

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        result = self.by_id.setdefault(report.nodeid, TestResult(name, property_of(name) or "?"))
        result.seconds += report.duration
        result.compared += [v for k, v in report.user_properties if k == "compared" and v not in result.compared]
        result.fidelity += [v for k, v in report.user_properties if k in ("fidelity", "sampling") and v not in result.fidelity]
        outcome = _outcome(report)
        if outcome == "fail" and result.outcome != "fail":  # the first failure decides (a teardown error may follow)
            result.outcome, result.message = outcome, _message(report)
            result.failure = getattr(report, "logdiff_failure", "error")
        elif outcome and result.outcome is None:
            result.outcome, result.message = outcome, ("" if outcome == "pass" else _message(report))
        if report.when == "teardown":
            result.outcome = result.outcome or "pass"
            result.engine_starts = remote.START_SECONDS[self._starts_before:]
            starts = result.engine_starts
            started = f", {len(starts)} engine start{'s' * (len(starts) > 1)} {sum(starts):.1f}s" if starts else ""
            done, elapsed = len(self.by_id), time.monotonic() - self.started
            left = elapsed / done * (self.total - done)  # tests differ a lot in cost: an estimate, said as one
            progress(f"[{done:>3}/{self.total}] {result.property:<4} {name}: {result.outcome} "
                     f"({result.seconds:.1f}s{started}; {_clock(elapsed)} elapsed, ~{_clock(left)} left)")


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


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
    """Per property: counts per outcome (a fail is "differ" or "error"), the verdict (fail > xfail > pass > skipped),
    the largest |a - b| of its bitwise pairs and the largest |logp - logp_fp64| (C0)."""
    out = {}
    for pid in selected:
        tests = [r for r in results if r.property == pid]
        counts = {o: sum(r.outcome == o for r in tests) for o in ("pass", "fail", "xfail", "xpass", "skipped")}
        counts |= {kind: sum(r.outcome == "fail" and r.failure == kind for r in tests) for kind in ("differ", "error")}
        if counts["fail"]:
            verdict = "fail"
        elif counts["xfail"]:
            verdict = "xfail"
        elif counts["pass"] or counts["xpass"]:
            verdict = "pass"
        else:
            verdict = "skipped"
        diffs = [c["max_abs_diff"] for r in tests for c in r.compared]
        errors = [f["max_abs_error"] for r in tests for f in r.fidelity if "max_abs_error" in f]
        out[pid] = {"meaning": catalogue[pid], "tests": len(tests), **counts, "verdict": verdict,
                    "max_abs_diff": max(diffs) if diffs else None, "max_abs_error_vs_fp64": max(errors) if errors else None}
    return out


def overall_verdict(verdicts: dict[str, dict]) -> str:
    """fail if a property fails; pass only if every property passes; skipped if the stack declined every one
    (nothing ran); partial if some were skipped or xfailed."""
    found = {v["verdict"] for v in verdicts.values()}
    if "fail" in found:
        return "fail"
    return "pass" if found == {"pass"} else "skipped" if found <= {"skipped"} else "partial"


def max_abs_logdiff(results: list[TestResult]) -> float | None:
    diffs = [c["max_abs_diff"] for r in results for c in r.compared if c["what"] == "rollout vs trainer"]
    return max(diffs) if diffs else None


def fidelity_by_side(results: list[TestResult]) -> dict[str, float]:
    """C0: the largest |logp - logp_fp64| of each side (rollout, trainer, prompt) over the catalogue."""
    out: dict[str, float] = {}
    for f in (f for r in results for f in r.fidelity if "side" in f):
        out[f["side"]] = max(out.get(f["side"], 0.0), f["max_abs_error"])
    return out


PAIRS_COLUMN, FP64_COLUMN = "max |a-b| bitwise pairs", "max |logp-fp64|"


def table_rows(verdicts: dict[str, dict]) -> list[dict]:
    """A row per property. `differ`: tests whose property does not hold; `error`: tests in which the stack erred.
    The figures: the largest |a - b| over the property's bitwise pairs (rollout vs trainer, batch vs alone, ...),
    and over its log-probs' distance from the fp64 oracle (C0)."""
    def figure(x):
        return "-" if x is None else report.fmt_float(x)

    return [
        {"property": pid, "what": v["meaning"].split(":")[0], "tests": v["tests"], "pass": v["pass"] + v["xpass"],
         "differ": v["differ"], "error": v["error"], "xfail": v["xfail"], "skipped": v["skipped"], "verdict": v["verdict"],
         PAIRS_COLUMN: figure(v["max_abs_diff"]), FP64_COLUMN: figure(v["max_abs_error_vs_fp64"])}
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
