"""Datasets: in-memory DataModules (:mod:`mtmoe.data.base`) and raw-file fetching (:mod:`mtmoe.data.download`)."""
from mtmoe.data.base import DatasetInfo, IndexBatches, InMemoryDataModule, TaskSpec
from mtmoe.data.books import BooksDataModule
from mtmoe.data.jester import JesterDataModule
from mtmoe.data.movielens import MovieLens1MDataModule, MovieLens100KDataModule, MovieLensDataModule

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

__all__ = [
    "DATASETS", "BooksDataModule", "DatasetInfo", "InMemoryDataModule", "IndexBatches", "JesterDataModule",
    "MovieLens100KDataModule", "MovieLens1MDataModule", "MovieLensDataModule", "TaskSpec",
]
