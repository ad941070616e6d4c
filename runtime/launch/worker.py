"""One process that runs several builds' rank scripts in turn (tests, benchmarks).

    python -m runtime.launch.worker --build B1 --arg=--steps --arg=3 ... --build B2 ...

For each build it runs build/run_rank.py (or the script build.json names,
runtime.launch.launcher.entry_script) exactly as a launcher would (the rank comes
from the environment), with that build's arguments. Starting Python and
torch once for many builds is what makes a test matrix of real multi-process
runs affordable on a small machine. A failing build ends the process with its
exit status (the launcher then stops the other ranks).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from runtime.launch.launcher import entry_script, read_build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="append", default=[], type=Path)
    ap.add_argument("--arg", action="append", default=[])
    # --arg values belong to the --build before them
    raw = list(sys.argv[1:] if argv is None else argv)
    jobs: list[tuple[Path, list[str]]] = []
    for item in raw:
        if item == "--build":
            jobs.append((None, []))  # type: ignore[arg-type]
        elif jobs and jobs[-1][0] is None:
            jobs[-1] = (Path(item), [])
        elif item.startswith("--arg="):
            jobs[-1][1].append(item[len("--arg="):])
        else:
            ap.error(f"unexpected argument {item!r}")
    for build, args in jobs:
        script = entry_script(build, read_build(build))
        sys.argv = [str(script), *args]
        code = runpy.run_path(str(script), run_name="meshplan_worker")["main"]()
        if code:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
