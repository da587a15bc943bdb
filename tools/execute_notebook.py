"""Execute one notebook in place from a clean kernel, storing outputs and widget state.

Usage: python tools/execute_notebook.py NOTEBOOK [--timeout SECONDS]

The kernel runs in the notebook's own folder. Cell timing metadata is not
recorded, so re-executing an unchanged notebook leaves the file unchanged
except where an output really changed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    args = parser.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(args.notebook.parent.resolve())}},
                            record_timing=False, store_widget_state=True)
    client.execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None) if not _has_widgets(nb) else None
    nbformat.write(nb, args.notebook)
    return 0


def _has_widgets(nb) -> bool:
    return any(out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
               for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []))


if __name__ == "__main__":
    sys.exit(main())
