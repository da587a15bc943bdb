"""Execute one notebook in place from a clean kernel, storing outputs and widget state.

Usage: python tools/execute_notebook.py NOTEBOOK [--timeout SECONDS]

The kernel runs in the notebook's own folder. Re-executing an unchanged
notebook leaves the file unchanged outside the cells tagged
``nbval-ignore-output`` (timings): cell timing metadata is not recorded, and
the widget model ids, which ipywidgets draws at random, are renamed to ids
derived from the notebook's name and each widget's order of appearance, and
consecutive pieces of one output stream are merged (how printed lines are split
depends on the machine's load). A one-sentence prose change then shows in
``git diff`` as that sentence alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
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
        if cell.cell_type == "code":
            cell.outputs = coalesce_streams(cell.outputs)
    nb.metadata.pop("widgets", None) if not _has_widgets(nb) else None
    nb = deterministic_widget_ids(nb, args.notebook.stem)
    nbformat.write(nb, args.notebook)
    return 0


WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def coalesce_streams(outputs):
    """Merge consecutive outputs of one stream (stdout, stderr) into one.

    How a cell's printed lines are split into stream outputs depends on when the
    kernel flushed them, which on a busy machine varies from run to run; merged,
    an unchanged cell stores the same output every time.
    """
    merged = []
    for out in outputs:
        if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == out.get("name")):
            merged[-1]["text"] = merged[-1]["text"] + out["text"]
        else:
            merged.append(out)
    return merged


def deterministic_widget_ids(nb, name: str):
    """Rename every widget model id to one derived from ``name`` and its order of first appearance."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    if not state:
        return nb
    text = json.dumps(nb)
    ids = set(state)
    order = []
    for m in re.finditer(r"[0-9a-f]{32}", text):
        if m.group(0) in ids and m.group(0) not in order:
            order.append(m.group(0))
    order += sorted(ids - set(order))
    new = {old: hashlib.sha256(f"{name}/widget/{i}".encode()).hexdigest()[:32] for i, old in enumerate(order)}
    text = re.sub(r"[0-9a-f]{32}", lambda m: new.get(m.group(0), m.group(0)), text)
    return nbformat.from_dict(json.loads(text))


def _has_widgets(nb) -> bool:
    return any(out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
               for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []))


if __name__ == "__main__":
    sys.exit(main())
