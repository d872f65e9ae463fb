"""Optuna studies: search spaces (:mod:`~mtmoe.tuning.space`), the tuning driver (:mod:`~mtmoe.tuning.study`)."""
