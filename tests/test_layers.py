"""The layers, bottom to top: planner -> runners -> views -> reporting -> app_pages -> app.py.
A module imports only from its own layer or those beneath it (at the top of a file or inside
a function alike), nothing beneath the pages imports Streamlit, and the planner and the
layers beneath the report never name the page or report packages, not even in a comment.
Read from the source with `ast`, so nothing is imported and a breach fails here in
milliseconds."""

from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import ROOT

LAYERS = ("planner", "runners", "views", "reporting", "app_pages", "app")  # bottom to top
BELOW_THE_PAGES = LAYERS[:LAYERS.index("app_pages")]


def layer_files(layer: str) -> list:
    return [ROOT / "app.py"] if layer == "app" else sorted((ROOT / layer).rglob("*.py"))


def imported_packages(source: str) -> set[str]:
    """Top-level names of every module a file imports: import and from-import statements
    anywhere in it, and importlib.import_module / __import__ calls with a literal name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            found.add(node.args[0].value.split(".")[0])
    return found


def breaches(layer: str, sources) -> list[str]:
    """`name imports package` for each of (name, source) that imports a layer above `layer`."""
    above = set(LAYERS[LAYERS.index(layer) + 1:])
    if layer in BELOW_THE_PAGES:
        above.add("streamlit")
    return [f"{name} imports {package}" for name, source in sources
            for package in sorted(imported_packages(source) & above)]


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_a_layer_above_its_own(layer):
    files = layer_files(layer)
    assert files, f"no Python files in {layer}"
    assert breaches(layer, [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in files]) == []


# Names that must not appear at all (code, comments, docstrings): what each lower package
# would otherwise know of the packages above it.
UNNAMED = {
    "planner": (r"\bapp_pages\b", r"\breporting\b", r"\bviews[./]"),
    "runners": (r"\bapp_pages\b", r"\breporting\b", r"\bviews[./]"),
    "views": (r"\bapp_pages\b", r"\breporting\b"),
    "reporting": (r"\bapp_pages\b",),
}


@pytest.mark.parametrize("layer", UNNAMED)
def test_lower_packages_never_name_the_ones_above(layer):
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in layer_files(layer)
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for pattern in UNNAMED[layer] if re.search(pattern, line)]
    assert found == []


def test_the_check_sees_a_breach():
    """The rule can fail: an import from above, nested in a function or dynamic, is found;
    one from beneath is not."""
    nested = "def f():\n    from app_pages.plan import render\n"
    dynamic = "import importlib\nbuild = importlib.import_module('reporting.build')\n"
    widget = "import streamlit as st\n"
    below = "from planner.units import format_bytes\nimport runners.history\n"
    assert breaches("views", [("nested", nested), ("dynamic", dynamic), ("widget", widget), ("below", below)]) == [
        "nested imports app_pages", "dynamic imports reporting", "widget imports streamlit"]
    assert breaches("planner", [("below", below)]) == ["below imports runners"]
    assert breaches("app_pages", [("widget", widget), ("below", below)]) == []
