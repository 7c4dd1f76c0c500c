"""``python -m tensorferry ARGS`` and the wheel's ``ferry`` console script: the ``ferry``
command (inspect, verify, convert, bench) that the wheel carries as tensorferry/bin/ferry.

The process becomes that program (exec), so its exit codes, signals (Ctrl-C during a
conversion) and terminal output are the command's own. FERRY_BIN names another binary (a
build tree's src/cli/ferry, say)."""

import os
import sys


def command_path():
    """The `ferry` binary this package runs, or None when it has none."""
    override = os.environ.get("FERRY_BIN")
    if override:
        return override
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "ferry")
    return here if os.access(here, os.X_OK) else None


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    path = command_path()
    if path is None:
        sys.stderr.write(
            "tensorferry: this installation has no `ferry` command (tensorferry/bin/ferry): "
            "install the package from its wheel (pip install ./bindings/python), or set "
            "FERRY_BIN to a built ferry binary\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, ["ferry"] + args)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
