"""`pytest conformance --stack NAME [--xfails-file PATH]`: the options, header and stack fixture come
from logdiff.conformance.plugin; `bitwise` compares and records."""

import pytest

from logdiff.conformance.plugin import (  # noqa: F401 (pytest finds hooks and fixtures by name here)
    fresh_for,
    oracle_for,
    own_for,
    parallel_options,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_report_header,
    pytest_runtest_call,
    pytest_runtest_setup,
    stack_builder,
    stack_for,
    trainer_for,
)

from .bitwise import Bitwise


@pytest.fixture
def bitwise(request) -> Bitwise:
    return Bitwise(request.node.user_properties)
