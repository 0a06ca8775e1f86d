"""Run train.py's main on each of several argument lists in this one process (start-up paid once),
as tests/test_bad_input.py's cases; print one JSON line per case: its exit code, what it wrote to
stderr, and the traceback if an exception escaped main (which a user would have seen).

    python tests/scripts/bad_inputs.py '[["--recipe", "tiny_sft", "data.task=", ...], ...]'
"""

import contextlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402


def main():
    out = sys.stdout
    for argv in json.loads(sys.argv[1]):
        escaped, code = "", None
        # files, not StringIO: some libraries ask stderr for its fileno
        with tempfile.TemporaryFile("w+") as err, open(os.devnull, "w") as devnull, \
                contextlib.redirect_stderr(err), contextlib.redirect_stdout(devnull):
            try:
                code = train.main(argv)
            except SystemExit as e:  # argparse
                code = e.code
            except BaseException:  # noqa: BLE001 - what the user would see as a traceback
                escaped = traceback.format_exc()
            err.seek(0)
            text = err.read()
        print(json.dumps({"argv": argv, "code": code, "stderr": text, "traceback": escaped}), file=out, flush=True)


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this module
    main()
