"""No module of ``fixedstate`` reaches into another module's private names.

The rule, checked here on the source of every ``.py`` file of ``code/fixedstate``
(the subpackages ``checks/`` and ``figures/`` included), by reading its syntax tree:

- A name with a leading underscore belongs to the module that defines it. Another
  module never imports it (``from .delta_rule import _flat``), never reads it as an
  attribute of a module it imported (``dr._chunkwise``, ``fixedstate.ssm._scan``,
  ``getattr(dr, "_x")``), and never patches it. What several modules share lives
  under a public name: the chunked kernels, the row softmax and the segment sums in
  ``fixedstate.kernels``, the rest in the public API of the module that owns it.
- A private *module* (``_validate``, ``_grad``, ``_threads``, ``checks._core``) may
  stay private, but what other modules use from it has a public name, imported
  plainly (``from ._threads import blas_threads``) or read as ``_threads.blas_threads``.
- No import renames a fixedstate module or name to a private alias
  (``from . import delta_rule as _dr``, ``import ... as _blas_threads``): the alias
  would hide where a name comes from behind a name that looks like the importer's own.

Names that begin and end with two underscores (``__version__``, ``__all__``) are
not private. Attributes of other objects (matplotlib's, numpy's, a class's own
``self._x``) are not this rule's concern.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "code" / "fixedstate"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_names(package_dir: Path) -> dict[str, Path]:
    """Every module and package of the package: dotted name -> file."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def violations(package_dir: Path = PACKAGE_DIR, files=None) -> list[str]:
    """Every breach of the rule in the package at ``package_dir``, as ``file:line: what``.

    With ``files`` (paths outside the package, such as the tests), the breaches in those
    files instead: every private name of the package's modules that they use.
    """
    modules = _module_names(package_dir)
    top = package_dir.name
    found = []
    if files is None:
        sources = list(modules.items())
    else:
        sources = [(f"<outside>.{Path(f).stem}", Path(f)) for f in files]
    for name, path in sources:
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        where = lambda node: (f"{path.relative_to(package_dir.parent)}:{node.lineno}" if files is None
                              else f"{path.name}:{node.lineno}")
        bound = {}                                          # local name -> the fixedstate module it names

        # the imports: what each binds, and the imports that break the rule
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == top or alias.name.startswith(top + "."):
                        if alias.asname is not None:
                            bound[alias.asname] = alias.name
                            if _private(alias.asname):
                                found.append(f"{where(node)}: imports {alias.name} as the private alias "
                                             f"{alias.asname}")
                        else:
                            bound[top] = top
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                elif node.module and (node.module == top or node.module.startswith(top + ".")):
                    source = node.module
                else:
                    continue                                    # another library's names
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    local = alias.asname or alias.name
                    if full in modules:
                        bound[local] = full
                    elif _private(alias.name) and source != name:
                        found.append(f"{where(node)}: imports the private name {alias.name} of {source}")
                    if alias.asname is not None and _private(alias.asname) and not _private(alias.name):
                        found.append(f"{where(node)}: imports {full} as the private alias {alias.asname}")
                    elif alias.asname is not None and _private(alias.asname) and full in modules:
                        found.append(f"{where(node)}: imports the module {full} as the private alias "
                                     f"{alias.asname}")

        def resolve(node):
            """The fixedstate module an expression names, or None."""
            if isinstance(node, ast.Name):
                return bound.get(node.id)
            if isinstance(node, ast.Attribute):
                owner = resolve(node.value)
                if owner is not None and f"{owner}.{node.attr}" in modules:
                    return f"{owner}.{node.attr}"
            return None

        # the attribute reads (and writes) of a private name of another module
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = resolve(node.value)
                if owner is not None and owner != name:
                    found.append(f"{where(node)}: uses the private name {node.attr} of {owner}")
            elif (isinstance(node, ast.Call) and len(node.args) >= 2
                  and ((isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr"))
                       or (isinstance(node.func, ast.Attribute) and node.func.attr in ("setattr", "delattr")))
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                owner = resolve(node.args[0])
                if owner is not None and owner != name:
                    how = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                    found.append(f"{where(node)}: uses the private name {node.args[1].value} of {owner} "
                                 f"through {how}")
    return found


def test_the_check_sees_every_module():
    names = _module_names(PACKAGE_DIR)
    assert {"fixedstate", "fixedstate.kernels", "fixedstate.delta_rule", "fixedstate.checks.delta",
            "fixedstate.figures", "fixedstate.figures.delta_rule", "fixedstate._threads"} <= set(names)


@pytest.mark.parametrize("source, expected", [
    ("from .delta_rule import _flat\n", "imports the private name _flat of fixedstate.delta_rule"),
    ("from . import delta_rule as dr\nx = dr._chunkwise\n", "uses the private name _chunkwise"),
    ("from . import delta_rule as _dr\n", "as the private alias _dr"),
    ("from ._threads import blas_threads as _blas_threads\n", "as the private alias _blas_threads"),
    ("import fixedstate.ssm\nfixedstate.ssm._scan = None\n", "uses the private name _scan of fixedstate.ssm"),
    ("import fixedstate\nfixedstate.ssm._scan(1, 2)\n", "uses the private name _scan of fixedstate.ssm"),
    ("from fixedstate import ssm\ngetattr(ssm, '_scan')\n", "through getattr"),
    ("def f():\n    from .softmax_attention import _row_softmax\n", "private name _row_softmax"),
])
def test_the_check_finds_each_kind_of_breach(tmp_path, source, expected):
    package = tmp_path / "fixedstate"
    package.mkdir()
    for module in ("__init__", "delta_rule", "ssm", "softmax_attention", "_threads"):
        (package / f"{module}.py").write_text("")
    (package / "user.py").write_text(source)
    found = violations(package)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("source", [
    "from ._validate import as_float_array\n",
    "from . import _threads\nwith _threads.blas_threads(1):\n    pass\n",
    "import numpy as np\nx = np._NoValue\n",
    "from . import delta_rule as dr\nx = dr.__name__\n",
    "class A:\n    def f(self):\n        return self._x\n",
])
def test_the_check_allows_what_the_rule_allows(tmp_path, source):
    package = tmp_path / "fixedstate"
    package.mkdir()
    for module in ("__init__", "delta_rule", "_threads", "_validate"):
        (package / f"{module}.py").write_text("")
    (package / "user.py").write_text(source)
    assert violations(package) == []


def test_no_module_reaches_into_another_modules_private_names():
    found = violations()
    assert not found, "private names used across modules:\n" + "\n".join(found)


TESTS_DIR = Path(__file__).resolve().parent


# Private names that tests of the modules of the other half of issue #29 (training, checks.layers,
# checks.training: the model vocabulary) still use; that half gives them internal names.
def test_the_tests_use_no_private_name_of_the_package():
    # the tests hold to the package's rule: what they need has a public (or documented internal) name, and
    # they pass sizes and recorders as arguments rather than patch a module (monkeypatch.setattr included)
    found = violations(files=sorted(TESTS_DIR.glob("*.py")))
    assert not found, "private names of fixedstate used by the tests:\n" + "\n".join(found)


def test_the_check_of_the_tests_finds_a_patched_private_name(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text("from fixedstate import kernels as dr\n"
                    "def test(monkeypatch):\n    monkeypatch.setattr(dr, '_GROUP_BYTES', 1)\n")
    found = violations(files=[test])
    assert len(found) == 1 and "_GROUP_BYTES of fixedstate.kernels through setattr" in found[0], found


def _public_modules() -> list[str]:
    """The package's public modules and subpackages, as the folder listing shows them."""
    names = [p.stem for p in PACKAGE_DIR.glob("*.py") if not p.stem.startswith("_")]
    return sorted(names + [p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists()])


def test_the_map_and_the_package_docstring_name_every_module():
    # CONTRIBUTING.md's map of the package and fixedstate's docstring each name every public module
    # (a new module is added to both); the map's table names the private ones too
    import fixedstate

    contributing = (PACKAGE_DIR.parents[1] / "CONTRIBUTING.md").read_text()
    table = contributing[contributing.index("### A map of the package"):]
    table = "\n".join(line for line in table.splitlines()[1:] if line.startswith("|"))
    modules = _public_modules()
    assert len(modules) > 20
    missing_map = [m for m in modules if f"`{m}`" not in table and f"`{m}/`" not in table]
    missing_doc = [m for m in modules if f":mod:`fixedstate.{m}`" not in fixedstate.__doc__]
    private = [p.stem for p in PACKAGE_DIR.glob("_*.py") if p.stem != "__init__"]
    missing_private = [m for m in private if f"`{m}`" not in table]
    assert not (missing_map or missing_doc or missing_private), (missing_map, missing_doc, missing_private)
