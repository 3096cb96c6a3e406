"""Whether a Python is inside pyproject.toml's requires-python; one line naming one that is, if not.

make runs it before it creates the virtual environment (vLLM 0.32/0.33 need 3.11 to 3.14, LMCache 0.5.6
below 3.14), so a wrong interpreter stops in one line instead of deep in pip. Written for any Python 3:
the interpreter it checks may be older than the project.

Usage: python scripts/check_python.py [--version X.Y]   (exit 0 inside, 1 outside)
"""

import os
import re
import shutil
import sys

PYPROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pyproject.toml")


def bounds(text):
    """(lowest, first excluded) minor versions of requires-python = ">=3.A,<3.B"."""
    spec = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.M).group(1)
    low = re.search(r">=\s*3\.(\d+)", spec)
    high = re.search(r"<\s*3\.(\d+)", spec)
    return spec, int(low.group(1)), int(high.group(1)) if high else 99


def main(argv):
    with open(PYPROJECT) as f:
        spec, low, high = bounds(f.read())
    version = tuple(sys.version_info[:2])
    if len(argv) == 2 and argv[0] == "--version":
        version = tuple(int(p) for p in argv[1].split(".")[:2])
    if version[0] == 3 and low <= version[1] < high:
        return 0
    found = [n for n in ("python3.%d" % m for m in range(low, high)) if shutil.which(n)]
    hint = "make PYTHON=%s" % found[0] if found else "install one (e.g. apt-get install python3.%d) and pass PYTHON=" % low
    print("%s is Python %d.%d; pytest-kvoffload needs Python %s (vLLM and LMCache's range): %s"
          % (sys.executable, version[0], version[1], spec, hint))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
