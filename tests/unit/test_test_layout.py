"""The test tree itself: pytest (prepend import mode, no __init__.py) imports every test file
by its basename, so two files with one name in different tiers stop the whole run. conftest.py
files are the exception: pytest imports each directory's own by its path (tests/conftest.py for
every session, tests/gpu/conftest.py for the gpu tier)."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_unique_across_tiers():
    by_name = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py":
            by_name[path.name].append(path.relative_to(TESTS).as_posix())
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
