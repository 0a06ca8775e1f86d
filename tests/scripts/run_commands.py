"""Documented commands, run one after another in one process from the current directory, as a reader
runs them (each can start from what the ones before it wrote): train.py's and the tools' own main(),
so start-up and imports are paid once. Their output goes to this process's; after it, a line
'RESULTS [...]' gives each command's exit status (it stops at the first that fails).

    python tests/scripts/run_commands.py '[["train.py", "--recipe", "tiny_sft", ...], ["tools/eval.py", ...]]'
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path.cwd()))  # a reward function module written beside the runs (my_pkg.rewards)


def entry_point(script: str):
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def main():
    results = []
    for script, *argv in json.loads(sys.argv[1]):
        print(f"$ {script} {' '.join(argv)}", flush=True)
        start = time.time()
        try:
            code = entry_point(script)(argv)
        except SystemExit as e:  # argparse
            code = e.code
        results.append({"command": [script, *argv], "code": code, "seconds": round(time.time() - start, 1)})
        if code:
            break
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this module
    main()
