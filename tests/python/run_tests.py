"""ctest's entry to the shard.torch tests: runs pytest on this folder, or exits 77 (ctest's
SKIP_RETURN_CODE) when this interpreter lacks torch or pytest (scripts/setup.sh installs
Debian's python3-torch and python3-pytest for /usr/bin/python3)."""

import importlib.util
import os
import sys

missing = [name for name in ("torch", "pytest") if importlib.util.find_spec(name) is None]
if missing:
    print(f"skipped: {sys.executable} cannot import {', '.join(missing)}")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main(["-v", "-p", "no:cacheprovider", os.path.dirname(os.path.abspath(__file__))]
                     + sys.argv[1:]))
