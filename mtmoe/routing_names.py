"""The names of the routing statistics of issue 35 (how each task gate routes, measured on the validation split by
:class:`mtmoe.pack.metrics.PackMetrics`) and how a run's results hold them; no torch import, so ``tune``'s records
and ``report`` read them without it."""
from __future__ import annotations

from typing import Any

#: Per task gate, in this order: ``<task>/<key>`` in an evaluation's results (``expert_overlap`` with two tasks or
#: more; ``selection_changed`` once a previous validation recorded the selections).
BEHAVIOUR_KEYS = ("routing_entropy", "expert_overlap", "expert_load", "selection_changed")


def routing_of(results: dict[str, Any]) -> dict[str, Any]:
    """The routing statistics among an evaluation's ``results``."""
    return {key: value for key, value in results.items() if key.rsplit("/", 1)[-1] in BEHAVIOUR_KEYS}


def routing_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per validated epoch of a trial's ``history``, its routing statistics (``results.json``'s ``routing``)."""
    return [{"epoch": record["epoch"], **routing_of(record["val"])} for record in history if "val" in record]
