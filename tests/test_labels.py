"""The package and the book stay wired together by equation labels.

Every public function that computes an equation of the book names that
equation's label (``eq-...``) in its docstring, and every label a docstring
names exists in the book, so a reader can go from the code to the text and
back, and a renamed or deleted equation cannot leave a dangling reference.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path

import pytest

import fixedstate

ROOT = Path(__file__).resolve().parents[1]
LABEL_USE = re.compile(r"\beq-[a-z0-9]+(?:-[a-z0-9]+)*")
LABEL_DEF = re.compile(r"\$\$\s*\((eq-[a-z0-9-]+)\)")

# The cores: every public function of these modules computes an equation.
CORE_MODULES = ["softmax_attention", "linear_attention", "delta_rule", "ssm", "gated_linear_attention", "delta_family"]


def book_labels() -> set[str]:
    labels = set()
    for nb in list(ROOT.glob("chapters/*.ipynb")) + list(ROOT.glob("appendix/*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                labels.update(LABEL_DEF.findall("".join(cell["source"])))
    for md in list(ROOT.glob("appendix/*.md")) + list(ROOT.glob("chapters/*.md")):
        labels.update(LABEL_DEF.findall(md.read_text()))
    return labels


def package_modules():
    for info in pkgutil.walk_packages(fixedstate.__path__, "fixedstate."):
        yield importlib.import_module(info.name)


def public_functions(module):
    names = getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")])
    for name in names:
        obj = getattr(module, name, None)
        if inspect.isfunction(obj) and obj.__module__ == module.__name__:
            yield name, obj


LABELS = book_labels()


def test_the_book_defines_labels():
    assert len(LABELS) > 50 and "eq-dr-gated" in LABELS


@pytest.mark.parametrize("module", list(package_modules()), ids=lambda m: m.__name__)
def test_every_label_named_in_the_package_exists_in_the_book(module):
    source = inspect.getsource(module)
    missing = sorted(set(LABEL_USE.findall(source)) - LABELS)
    assert not missing, f"{module.__name__} names labels the book does not define: {missing}"


@pytest.mark.parametrize("module_name", CORE_MODULES)
def test_every_public_core_names_its_equation(module_name):
    module = importlib.import_module(f"fixedstate.{module_name}")
    unnamed = [name for name, fn in public_functions(module) if not LABEL_USE.search(fn.__doc__ or "")]
    assert not unnamed, f"public functions of {module_name} whose docstring names no eq- label: {unnamed}"
