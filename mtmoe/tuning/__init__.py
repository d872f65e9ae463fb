"""Optuna studies: search spaces (:mod:`~mtmoe.tuning.space`), the tune driver (:mod:`~mtmoe.tuning.study`), storages
(:mod:`~mtmoe.tuning.storage`), the trial table (:mod:`~mtmoe.tuning.trials`), the report
(:mod:`~mtmoe.tuning.report`), the bootstrap's estimators (:mod:`~mtmoe.tuning.bootstrap`) and its report
(:mod:`~mtmoe.tuning.bootstrap_report`)."""
