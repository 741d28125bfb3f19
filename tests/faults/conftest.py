"""pytest set-up of the fault tests: skipped (saying why) where test hosts cannot be built,
an undisturbed reference run shared by the tests of one session, and SIGTERM unwinding like
Ctrl-C so that every process and namespace goes."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts as fault_hosts  # noqa: E402

fault_hosts.raise_on_sigterm()


def pytest_collection_modifyitems(config, items):
    reason = fault_hosts.unavailable()
    if reason is None:
        return
    for item in items:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Final parameters of undisturbed runs, by job spec (Reference.of(job))."""
    return fault_hosts.Reference(str(tmp_path_factory.mktemp("references")))
