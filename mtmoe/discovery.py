"""Finding the gates and datasets without importing them: a registered class is one file of the package with a
``@register_...("name")`` line on the class, or an installed distribution's entry point (``[project.entry-points]``,
the group ``mtmoe.gates`` or ``mtmoe.datasets``: ``name = "module:Class"``), as pytest and Optuna find plugins.

The files are read, not imported (the standard library's ``ast``), so listing the names, or rejecting an unknown
one, costs no torch or Lightning import; the class is imported when it is used (:func:`import_object`).
"""
from __future__ import annotations

import ast
import importlib
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from mtmoe.errors import UsageError


def class_literals(node: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> dict[str, Any]:
    """The attributes a class body sets to a literal (``name = "text"``), its bases' among ``classes`` (the file's)
    first, so that the class's own win."""
    found: dict[str, Any] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            found.update(class_literals(classes[base.id], classes))
    for statement in node.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant):
            found.update({target.id: statement.value.value for target in statement.targets
                          if isinstance(target, ast.Name)})
    return found


def registrations(package: str, decorator: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """``name -> ("module:Class", literals)`` for every class of the package ``package`` (its folder beside this
    file) marked ``@decorator("name")``, ``literals`` its literal class attributes (:func:`class_literals`: a
    registered class's static facts, read without importing it); a name marked twice is an error."""
    folder = Path(__file__).resolve().parent.joinpath(*package.split(".")[1:])
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.py")):
        body = ast.parse(path.read_text(), str(path)).body
        classes = {node.name: node for node in body if isinstance(node, ast.ClassDef)}
        for node in classes.values():
            for mark in node.decorator_list:
                if (isinstance(mark, ast.Call) and getattr(mark.func, "id", None) == decorator and mark.args
                        and isinstance(mark.args[0], ast.Constant) and isinstance(mark.args[0].value, str)):
                    name, where = mark.args[0].value, f"{package}.{path.stem}:{node.name}"
                    if name in found:
                        raise RuntimeError(f"{name!r} registered twice: {found[name][0]} and {where}")
                    found[name] = where, class_literals(node, classes)
    return found


def registered_in_files(package: str, decorator: str) -> dict[str, str]:
    """``name -> "module:Class"`` of the package's registered classes (:func:`registrations`)."""
    return {name: where for name, (where, _) in registrations(package, decorator).items()}


def registered(package: str, decorator: str, group: str) -> dict[str, str]:
    """The package's own classes (:func:`registered_in_files`) and the entry points of ``group``, by name; an entry
    point may not take a name the package uses."""
    found = registered_in_files(package, decorator)
    for point in entry_points(group=group):
        if point.name in found and found[point.name] != point.value:
            dist = point.dist.name if point.dist else "an installed distribution"
            raise UsageError(f"the entry point {point.name!r} of {dist} (group {group}) takes the name of "
                             f"{found[point.name]}: rename it in that distribution's entry points")
        found[point.name] = point.value
    return found


def import_object(path: str, what: str) -> object:
    """The object at ``"module:Name"``; a module that cannot be imported or lacks the name is one UsageError line."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"{what} {path!r}: cannot import {module_name!r} ({error}); put its folder on PYTHONPATH "
                         "or install its distribution") from None
    if not hasattr(module, name):
        raise UsageError(f"{what} {path!r}: module {module_name!r} has no {name!r}")
    return getattr(module, name)
