"""Datasets: in-memory DataModules (:mod:`mtmoe.data.base`) and raw-file fetching (:mod:`mtmoe.data.download`).

The package's names are imported when first used: ``DATASETS`` (:func:`dataset_paths`: what ``python -m mtmoe
datasets`` lists) and a dataset's task weighting (:func:`task_weighting`, what ``report`` and ``bootstrap`` need)
cost no Lightning import.
"""
import importlib
from functools import cache

from mtmoe.discovery import import_object, registrations, registered


@cache
def dataset_paths() -> dict[str, str]:
    """Every registered dataset's CLI name -> the import path of its DataModule class (``pkg.module.Class``): the
    files of ``mtmoe/data/`` with an ``@register_dataset("name")`` class, and the entry points of the group
    ``mtmoe.datasets``; nothing is imported."""
    found = registered("mtmoe.data", "register_dataset", "mtmoe.datasets")
    return {name: path.replace(":", ".") for name, path in found.items()}


def dataset_path(name: str) -> str:
    """The import path of dataset ``name``'s DataModule; an unknown name is a one-line UsageError."""
    from mtmoe.errors import UsageError, suggestion

    paths = dataset_paths()
    if name not in paths:
        raise UsageError(f"unknown dataset {name!r}; valid datasets: {', '.join(sorted(paths))}"
                         f"{suggestion(name, paths)}")
    return paths[name]


@cache
def task_weighting(name: str) -> str | None:
    """How dataset ``name`` weights its tasks, ``alpha`` or ``equal`` (``None``: not a registered dataset): its
    DataModule's ``task_weighting`` literal, read from the file without importing it; a DataModule that inherits it
    from another file's class, or an entry point's, is imported and instantiated (``download=False``) instead."""
    _, literals = registrations("mtmoe.data", "register_dataset").get(name, (None, {}))
    if "task_weighting" in literals:
        return literals["task_weighting"]
    found = registered("mtmoe.data", "register_dataset", "mtmoe.datasets")
    return import_object(found[name], "dataset")(download=False).info.task_weighting if name in found else None


_MODULES = {  # exported name -> its module
    "DatasetInfo": "mtmoe.data.base", "IndexBatches": "mtmoe.data.base", "InMemoryDataModule": "mtmoe.data.base",
    "TaskSpec": "mtmoe.data.base", "BooksDataModule": "mtmoe.data.books", "JesterDataModule": "mtmoe.data.jester",
    "MovieLens100KDataModule": "mtmoe.data.movielens", "MovieLens1MDataModule": "mtmoe.data.movielens",
    "MovieLensDataModule": "mtmoe.data.movielens",
}


def __getattr__(name: str):
    if name == "DATASETS":  # what ``python -m mtmoe datasets`` lists
        return dataset_paths()
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DATASETS", "dataset_path", "dataset_paths", "task_weighting", "BooksDataModule", "DatasetInfo",
    "InMemoryDataModule", "IndexBatches", "JesterDataModule", "MovieLens100KDataModule", "MovieLens1MDataModule",
    "MovieLensDataModule", "TaskSpec",
]
