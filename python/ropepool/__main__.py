"""``python -m ropepool verify|bench|--help``: the ``ropepool`` command-line tool, as
installed inside the package (``ropepool/bin/ropepool``), with the same arguments and exit
status."""

import os
import subprocess
import sys
from pathlib import Path


def _cli_path() -> Path:
    return Path(__file__).resolve().parent / "bin" / "ropepool"


def main() -> int:
    cli = _cli_path()
    if not os.access(cli, os.X_OK):
        print(f"ropepool: the command-line tool is not part of this installation ({cli} "
              "is missing); it is built when the package is built with ROPEPOOL_BUILD_CLI=ON, "
              "the default", file=sys.stderr)
        return 2
    argv = ["ropepool", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(cli, argv)  # replaces this process: the exit status is the tool's own
    return subprocess.run([str(cli), *argv[1:]]).returncode


if __name__ == "__main__":
    sys.exit(main())
