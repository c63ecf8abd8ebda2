"""The pytest side of the conformance catalogue: `--stack` and `--xfails-file`, the report header
(the stack, its versions and device), one stack per (model, dtype) built on first use, and the rule
that a stack declining a property (`Unsupported`) is reported as skipped, never as passed.

`conformance/conftest.py` imports these hooks and fixtures; `logdiff check` reads `stack_info`.
"""

from __future__ import annotations

import dataclasses
import shlex
import warnings
from pathlib import Path

import pytest

from logdiff import devices, report, stacks
from logdiff.api import ENTRY_POINT_GROUP, Stack, Unsupported
from logdiff.errors import UserError
from logdiff.stacks import StackCache
from logdiff.weights import check_model_option
from logdiff.workload import Workload

DEFAULT_STACK = "reference"
# Stacks are built for 512 positions (every edge workload) or, for the long-context regimes, 8192: naive's
# attention spans its whole max_model_len, so one long build for everything would slow every workload.
MAX_MODEL_LEN, LONG_MODEL_LEN = 512, 8192
DEFAULT_EXAMPLES = 4

STACK_INFO = pytest.StashKey[dict]()
_BUILT = pytest.StashKey[dict]()
_XFAILS = pytest.StashKey[dict]()
_DEVICE = pytest.StashKey[object]()  # the open `devices.using` of --device
_WORKLOADS = pytest.StashKey[list]()
_PARALLEL = pytest.StashKey[tuple]()  # (options for run and bisect, options for bisect only) of a sharded test
_BISECTABLE = pytest.StashKey[bool]()  # every stack the test built implements capture: `logdiff bisect` can run on it


def pytest_addoption(parser):
    group = parser.getgroup("logdiff", "logdiff conformance")
    group.addoption(
        "--stack", default=DEFAULT_STACK, metavar="NAME",
        help="stack under test: a built-in name, module:attr, or a name registered under the entry-point "
             f"group {ENTRY_POINT_GROUP} (default {DEFAULT_STACK})",
    )
    group.addoption(
        "--model", default=None, metavar="NAME|DIR",
        help="run every workload on this model (a named config or a checkpoint directory) instead of its own; "
             "a property whose workload builds its own weights (C9's tied router) is skipped, with the reason",
    )
    group.addoption(
        "--layers", type=int, default=None, metavar="N",
        help="with --model: keep its first N decoder layers (embeddings, final norm and lm_head kept), the quick "
             "gate on a real checkpoint (default: all)",
    )
    group.addoption(
        "--device", default="cpu", metavar="NAME",
        help="where the stacks built on torch and the fp64 oracle compute: cpu, cuda, npu, xpu (default cpu); a "
             "kernel set without order-fixed kernels for it declines every property (skipped, with the reason)",
    )
    group.addoption(
        "--workload-seed", type=int, default=0, metavar="S",
        help="seed of the generated workloads (hypothesis) beside the fixed ones (default 0)",
    )
    group.addoption(
        "--workload-examples", type=int, default=DEFAULT_EXAMPLES, metavar="N",
        help=f"generated workloads per property (default {DEFAULT_EXAMPLES}; 0 runs the fixed workloads only)",
    )
    group.addoption(
        "--workload-shrink-seconds", type=float, default=None, metavar="S",
        help="shrink a failing generated workload for at most S seconds after the failure (default: hypothesis' "
             "own limit); the verdict never depends on it, only the reproducer's size",
    )
    group.addoption(
        "--xfails-file", metavar="PATH",
        help="known gaps of this stack: one test id per line (file.py::test[params], test[params] or a test "
             "function name; # starts a comment); those tests are reported as xfail",
    )


def pytest_configure(config):
    name = config.getoption("--stack")
    try:
        stacks.resolve_whole(name)
    except UserError as e:
        raise pytest.UsageError(str(e)) from None
    try:
        check_model_option(config.getoption("--model"), config.getoption("--layers"))
        device = devices.resolve(config.getoption("--device"))
    except UserError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[_DEVICE] = devices.using(device)
    config.stash[_DEVICE].__enter__()
    path = config.getoption("--xfails-file")
    config.stash[_XFAILS] = read_xfails(Path(path)) if path else {}
    config.stash[_BUILT] = {}
    config.addinivalue_line("markers", "own_weights(what): a conformance test whose workloads build their own weights; "
                                       "skipped under --model")
    config.addinivalue_line("markers", "check_only: a property `logdiff run` and `bisect` do not exercise (trainer "
                                       "layouts, weight updates): its failure reproduces through `logdiff check -k` only")


def pytest_unconfigure(config):
    if _DEVICE in config.stash:
        config.stash[_DEVICE].__exit__(None, None, None)


def read_xfails(path: Path) -> dict[str, int]:
    """Test id -> line number."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise pytest.UsageError(
            f"cannot read --xfails-file {path} ({e.strerror}); pass a text file, one test id per line") from None
    ids = {}
    for number, line in enumerate(lines, 1):
        test_id = line.split("#", 1)[0].strip()
        if test_id:
            # Node ids depend on where pytest runs from; keep the file name and what follows.
            ids[test_id.rsplit("/", 1)[-1]] = number
    return ids


def _ids(item) -> set[str]:
    return {item.name, item.originalname, f"{item.path.name}::{item.name}", f"{item.path.name}::{item.originalname}"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    model = config.getoption("--model")
    for item in items:
        own = item.get_closest_marker("own_weights")
        if model and own:
            item.add_marker(pytest.mark.skip(reason=f"builds its own weights ({own.args[0]}), not {model}'s"))
    xfails = config.stash[_XFAILS]
    if not xfails:
        return
    used = set()
    for item in items:
        listed = _ids(item) & set(xfails)
        if listed:
            used |= listed
            item.add_marker(pytest.mark.xfail(reason=f"known gap, listed in {config.getoption('--xfails-file')}", strict=False))
    for test_id in sorted(set(xfails) - used, key=xfails.get):
        warnings.warn(pytest.PytestWarning(f"--xfails-file line {xfails[test_id]}: {test_id!r} names no collected test"))


def _declined_is_skipped(item):
    try:
        return (yield)
    except Unsupported as e:
        pytest.skip(f"stack {item.config.getoption('--stack')} declines: {e}")
    except Exception as e:  # a violation, or the stack erring (an engine that crashed): either is reproduced the same way
        e.add_note(reproducer(item, e))
        raise


def reproducer(item, error: BaseException) -> str:
    """The command lines that reproduce a failing test, each runnable as printed from any directory (the models are
    named configs): the test itself through `logdiff check`, and `logdiff run` / `logdiff bisect` (where the stack
    implements capture, which bisect needs) on the workloads that failed (a generated test's error names them:
    logdiff.conformance.generated), else on the last workload the test ran."""
    config = item.config
    stack = shlex.quote(config.getoption("--stack"))
    generated = "".join(f" {flag} {config.getoption(flag)}" for flag, default in (
        ("--workload-seed", 0), ("--workload-examples", DEFAULT_EXAMPLES)) if config.getoption(flag) != default)
    model = config.getoption("--model")
    layers = config.getoption("--layers")
    on = (f" --model {shlex.quote(model)}" if model else "") + (f" --layers {layers}" if model and layers else "")
    lines = [f"reproduce: logdiff check --stack {stack}{on} -k {shlex.quote(item.name)}{generated}"]
    if item.get_closest_marker("check_only"):  # `logdiff run` and `bisect` exercise another property
        return "\n".join(lines)
    degrees, bisect_only = item.stash.get(_PARALLEL, ("", ""))
    for w in getattr(error, "workloads", None) or item.stash.get(_WORKLOADS, [])[-1:]:
        w = on_model(config, w)
        lines.append(f"reproduce: logdiff run --stack {stack} {w.command_line()}{degrees}")
        if item.stash.get(_BISECTABLE, False):
            lines.append(f"locate:    logdiff bisect --stack {stack} {w.command_line()}{degrees}{bisect_only}")
    return "\n".join(lines)


@pytest.fixture
def parallel_options(request):
    """A sharded test names the degrees its failure reproduces at: `parallel_options("--tp 2", "--path rollout")`
    adds them to its `logdiff run` / `logdiff bisect` lines (the second only to bisect's)."""

    def record(degrees: str, bisect_only: str = "") -> None:
        request.node.stash[_PARALLEL] = (f" {degrees}", f" {bisect_only}" if bisect_only else "")

    return record


# Fixtures run in setup, tests in call: a stack may decline in either.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _declined_is_skipped(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _declined_is_skipped(item))


def build_stack(config, workload: Workload, instance: str = "rollout", max_model_len: int = MAX_MODEL_LEN) -> Stack:
    """The stack under test for this workload's model and dtype, built once per `instance`; a declined build
    is remembered. The trainer side is scored on its own instance (a fresh factory call, same weights), so
    a trainer cannot answer from the rollout's memory."""
    # On --model (real dimensions), one dtype's instances at a time: all of them would not fit in memory.
    cache = config.stash[_BUILT].setdefault(instance, StackCache(keep_one_model=bool(config.getoption("--model"))))
    return cache.get(config.getoption("--stack"), workload.spec, workload.torch_dtype, max_model_len)


def stack_info(config) -> dict:
    """What `Stack.describe()` says about the stack (fp32, default model), plus the platform."""
    if STACK_INFO not in config.stash:
        name = config.getoption("--stack")
        default = Workload()
        try:
            describe = build_stack(config, default).describe()
        except Unsupported as e:
            describe = {"name": name, "unavailable": str(e)}
        config.stash[STACK_INFO] = {"stack": name, "describe": describe, "platform": report.platform_info()}
    return config.stash[STACK_INFO]


def pytest_report_header(config):
    info = stack_info(config)
    describe = dict(info["describe"])
    versions = describe.pop("versions", {})
    lines = [f"logdiff conformance: stack {info['stack']}, device {describe.pop('device', 'unknown')}"]
    if versions:
        lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    describe.pop("name", None)
    if "rollout" in describe and "trainer" in describe:  # a pair: each side's line
        lines.append("  " + report.kernels_line(info["stack"], describe))
        describe = {}
    kernels = describe.pop("kernels", None)
    if describe:
        lines.append("  " + ", ".join(f"{k}: {v}" for k, v in describe.items()))
    if kernels:
        lines.append("  " + report.kernels_line(info["stack"], {"kernels": kernels}))
    p = info["platform"]
    lines += ["  " + report.platform_line(p), "  " + report.provenance_line(p)]
    return lines


def on_model(config, workload: Workload) -> Workload:
    """The workload on `--model` where one is given: its prompts (ids of the small vocabulary, valid in any
    larger one), lengths and sampling stay; the weights are the model's."""
    model = config.getoption("--model")
    return dataclasses.replace(workload, model=model, layers=config.getoption("--layers")) if model else workload


def model_len_for(workload: Workload) -> int:
    """The max_model_len of the stacks that run `workload`."""
    if workload.max_model_len > LONG_MODEL_LEN:
        raise ValueError(
            f"catalogue workload needs {workload.max_model_len} positions, stacks are built with at most {LONG_MODEL_LEN}")
    return MAX_MODEL_LEN if workload.max_model_len <= MAX_MODEL_LEN else LONG_MODEL_LEN


def _builder(config, instance: str):
    def get(workload: Workload) -> Stack:
        span = model_len_for(workload)
        return build_stack(config, on_model(config, workload), instance, span)

    return get


@pytest.fixture(scope="session")
def stack_builder(pytestconfig):
    """stack_builder(workload) -> the stack under test, built for the workload's model and dtype (once per
    session). For fixtures wider than one test; tests use `stack_for`."""
    return _builder(pytestconfig, "rollout")


def _remembering(request, builder):
    used = request.node.stash.setdefault(_WORKLOADS, [])

    def get(workload: Workload) -> Stack:
        used.append(workload)
        stack = builder(workload)
        request.node.stash[_BISECTABLE] = request.node.stash.get(_BISECTABLE, True) and stack.supports_capture
        return stack

    return get


@pytest.fixture
def stack_for(request, stack_builder):
    """stack_for(workload) -> the stack under test (its rollout side); the workload is remembered for the
    failure's reproducer."""
    return _remembering(request, stack_builder)


@pytest.fixture
def trainer_for(request, pytestconfig):
    """trainer_for(workload) -> a second instance of the stack under test, for its trainer side."""
    return _remembering(request, _builder(pytestconfig, "trainer"))


@pytest.fixture
def own_for(request, pytestconfig):
    """own_for(workload) -> a new instance of the stack under test for this call alone, never cached: for tests
    that change its weights (C14)."""

    def get(workload: Workload) -> Stack:
        workload = on_model(pytestconfig, workload)
        factory = stacks.resolve_whole(pytestconfig.getoption("--stack"))
        return factory(workload.spec, workload.torch_dtype, model_len_for(workload))

    return _remembering(request, get)


@pytest.fixture
def fresh_for(request, pytestconfig):
    """fresh_for(workload) -> a third instance, for determinism across instances (C1)."""
    return _remembering(request, _builder(pytestconfig, "fresh"))


@pytest.fixture(scope="session")
def oracle_for(pytestconfig):
    """oracle_for(workload) -> the fp64 oracle of the workload's model, with the weights its dtype stores."""
    from logdiff.oracle import Oracle

    built = {}

    def get(workload: Workload):
        workload = on_model(pytestconfig, workload)
        key = (workload.spec, workload.dtype)
        if key not in built:
            if pytestconfig.getoption("--model"):
                built.clear()
            try:
                built[key] = Oracle(workload.spec, workload.torch_dtype)
            except Unsupported as e:
                built[key] = e
        if isinstance(built[key], Unsupported):
            raise built[key]
        return built[key]

    return get
