"""Which code trained a result: each trial of a study records it (user attribute ``code``), so that a study resumed
under other code, as a GPU study is from lease to lease, says which trials each trained (``report``'s "trained on"
names them where a study's trials have more than one)."""
from __future__ import annotations

import functools
import os
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

#: Names the code where git cannot: a copy of a checkout without its history or with a stale one
#: (``benchmarks/gpu_check.py`` sets it, on a lent GPU, to the commit ``gather`` recorded).
ENVIRONMENT = "MTMOE_CODE"


@functools.cache
def code_version() -> str:
    """``$MTMOE_CODE`` where set; else, run from a git checkout of mtmoe, its commit as ``git describe --always
    --dirty`` writes it (``5252e5a``, ``5252e5a-dirty`` with changes not committed); else the installed version
    (``0.1.0``), or ``unknown``. Computed once a process."""
    if os.environ.get(ENVIRONMENT):
        return os.environ[ENVIRONMENT]
    return git_describe(Path(__file__).resolve().parent.parent) or installed_version() or "unknown"


def git_describe(root: Path) -> str | None:
    """The commit of the git checkout ``root`` as ``git describe --always --dirty`` writes it; ``None`` where
    ``root`` is no checkout's top (an installed mtmoe: not the repository some folder above it may be) or git
    cannot say."""
    if not (root / ".git").exists():
        return None
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    described = git.stdout.strip() if git.returncode == 0 else ""
    return described or None


def installed_version() -> str | None:
    """The installed distribution's version (pyproject.toml's), ``None`` where mtmoe is not installed."""
    try:
        return version("mtmoe")
    except PackageNotFoundError:
        return None
