"""Execute notebooks in place (refreshing their committed outputs), one kernel each.

    python tools/maintenance/execute_notebooks.py book/*.ipynb [--timeout 900]

Used by tools/gpu_check.sh on a GPU machine so the rendered book shows GPU numbers. Prints the time
per notebook and exits non-zero if any cell raised (the notebook is still written, with the error).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = ap.parse_args(argv)
    failed = []
    for path in args.notebooks:
        nb = nbformat.read(path, as_version=4)
        t0 = time.time()
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
            status = "ok"
        except CellExecutionError as e:
            status = "FAILED"
            failed.append(path)
            print(str(e)[-3000:], file=sys.stderr)
        nbformat.write(nb, path)
        print(f"{status:6} {path} ({time.time() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
