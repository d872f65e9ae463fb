"""Datasets: in-memory DataModules (:mod:`mtmoe.data.base`) and raw-file fetching (:mod:`mtmoe.data.download`).

The package's names are imported when first used: ``DATASETS`` (what ``python -m mtmoe datasets`` lists) costs no
Lightning import.
"""
import importlib

DATASETS: dict[str, str] = {  # CLI name -> import path of the DataModule class
    "movielens": "mtmoe.data.movielens.MovieLens1MDataModule",
    "movielens-100k": "mtmoe.data.movielens.MovieLens100KDataModule",
    "books": "mtmoe.data.books.BooksDataModule",
    "jester": "mtmoe.data.jester.JesterDataModule",
    "multimnist": "mtmoe.data.multimnist.MultiMNISTDataModule",
    "multifashionmnist": "mtmoe.data.multimnist.MultiFashionMNISTDataModule",
    "celeba": "mtmoe.data.celeba.CelebADataModule",
    "digits": "mtmoe.data.digits.DigitsDataModule",
}



def dataset_path(name: str) -> str:
    """The import path of dataset ``name``'s DataModule; an unknown name is a one-line UsageError."""
    from mtmoe.errors import UsageError

    if name not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; valid datasets: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


_MODULES = {  # exported name -> its module
    "DatasetInfo": "mtmoe.data.base", "IndexBatches": "mtmoe.data.base", "InMemoryDataModule": "mtmoe.data.base",
    "TaskSpec": "mtmoe.data.base", "BooksDataModule": "mtmoe.data.books", "JesterDataModule": "mtmoe.data.jester",
    "MovieLens100KDataModule": "mtmoe.data.movielens", "MovieLens1MDataModule": "mtmoe.data.movielens",
    "MovieLensDataModule": "mtmoe.data.movielens",
}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DATASETS", "dataset_path", "BooksDataModule", "DatasetInfo", "InMemoryDataModule", "IndexBatches", "JesterDataModule",
    "MovieLens100KDataModule", "MovieLens1MDataModule", "MovieLensDataModule", "TaskSpec",
]
