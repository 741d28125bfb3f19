"""ctest's entry to the fault tests (faults_*): runs pytest on the files given (default: this
folder), or exits 77 (ctest's SKIP_RETURN_CODE) saying why when test hosts cannot be built here
(not root, no `ip netns`, no iptables) or pytest is missing. Other arguments go to pytest
(-k, -x, ...)."""

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hosts  # noqa: E402

reason = hosts.unavailable()
if reason is not None:
    print(f"skipped: {reason}")
    sys.exit(77)
if importlib.util.find_spec("pytest") is None:
    print(f"skipped: {sys.executable} cannot import pytest (scripts/setup.sh installs "
          "python3-pytest)")
    sys.exit(77)
missing = hosts.missing_binaries()
if missing:
    print(missing)
    sys.exit(1)

import pytest  # noqa: E402

files = [a for a in sys.argv[1:] if a.endswith(".py")] or [HERE]
rest = [a for a in sys.argv[1:] if not a.endswith(".py")]
# -s: the tests print what they saw (timings, events, differences) as they go, into ctest's log.
sys.exit(pytest.main(["-v", "-s", "-p", "no:cacheprovider", *files, *rest]))
