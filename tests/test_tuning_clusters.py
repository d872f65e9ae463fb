"""Studies across GPUs and machines (issue 35, item 4) and the Optuna internals the tune worker still relies on
(issue 34, item 4): each worker's GPU, ``--storage grpc://HOST:PORT`` through a real ``GrpcStorageProxy`` server on
loopback, and the recipes of docs/clusters.md."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from conftest import run_cli
from pg import free_port
from test_docs import code_blocks, shell_words
from test_tuning import TINY, assert_each_config_once, run_tune, trials_of, tune_args
from test_tuning_packs import FAST
from mtmoe.tuning import storage as storage_module
from mtmoe.tuning.objective import suggest
from mtmoe.tuning.packs import claimed_trial
from mtmoe.tuning.storage import trial_id
from mtmoe.tuning.study import gpu_names, parse_tune_args, worker_devices

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "docs" / "clusters.md"


def test_workers_take_the_gpus_round_robin() -> None:
    assert worker_devices(5, ["0", "1"]) == ["0", "1", "0", "1", "0"]
    assert worker_devices(2, ["0", "1", "2", "3"]) == ["0", "1"]
    assert worker_devices(3, ["GPU-a", "GPU-b", "GPU-c"]) == ["GPU-a", "GPU-b", "GPU-c"]
    assert worker_devices(3, ["0"]) == worker_devices(3, []) == [None, None, None]  # one GPU or none: left alone


def test_the_gpus_are_named_as_cuda_visible_devices_names_them() -> None:
    assert gpu_names(4, None) == ["0", "1", "2", "3"]
    assert gpu_names(2, "3, 5") == ["3", "5"]
    assert gpu_names(1, "GPU-aa,GPU-bb") == ["GPU-aa"]  # CUDA saw only the first
    assert gpu_names(0, None) == gpu_names(0, "0,1") == []


def test_without_gpus_the_workers_get_no_device() -> None:
    """This machine's own answer (no CUDA device here): every worker left as it is, no line printed."""
    import torch

    if torch.cuda.device_count() > 1:
        pytest.skip("a machine with several GPUs")
    assert set(worker_devices(4, gpu_names(torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")))) == {
        None}


def test_optuna_trial_of_a_claimed_trial(tmp_path: Path) -> None:
    """The private use packs.claimed_trial keeps (``optuna.Trial(study, trial_id)``, as ``Study.ask`` makes it): a
    waiting trial claimed by the public storage API is the live trial of that number, suggests its planned values
    and is told as ``ask``'s trials are. Fails when Optuna changes the constructor or what it reads."""
    storage = storage_module.storage_for(f"journal:{tmp_path / 'j.log'}")
    study = optuna.create_study(study_name="s", storage=storage)
    distribution = optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)
    for value in (0.01, 0.002):
        study.enqueue_trial({"lr": value})
    second = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))[1]
    claimed_id = trial_id(storage, study, second.number)
    assert storage.set_trial_state_values(claimed_id, TrialState.RUNNING)
    trial = claimed_trial(study, claimed_id)
    assert trial.number == second.number
    assert suggest(trial, "lr", distribution) == 0.002
    trial.set_user_attr("worker", "here")
    study.tell(trial, 1.5)
    done = study.get_trials(deepcopy=False)[second.number]
    assert (done.state, done.params, done.value, done.user_attrs) == (TrialState.COMPLETE, {"lr": 0.002}, 1.5,
                                                                      {"worker": "here"})
    assert study.get_trials(deepcopy=False)[0].state == TrialState.WAITING  # the other one untouched


@pytest.mark.parametrize("url, message", [
    ("grpc://", "is not a gRPC proxy address: write grpc://HOST:PORT"),
    ("grpc://proxy", "is not a gRPC proxy address"),
    ("grpc://proxy:port", "is not a gRPC proxy address"),
    ("grpc://proxy:13000/db", "is not a gRPC proxy address"),
])
def test_a_bad_grpc_url_is_one_error_line(tiny_root: Path, tmp_path: Path, capsys, url: str, message: str) -> None:
    assert run_cli(tune_args(url, tiny_root, tmp_path / "runs")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_an_unreachable_grpc_proxy_is_one_error_line(tiny_root: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(storage_module, "GRPC_CONNECT_TIMEOUT", 1)  # nothing listens: no need to wait 20 s
    port = free_port()
    assert run_cli(tune_args(f"grpc://127.0.0.1:{port}", tiny_root, tmp_path / "runs", *FAST)) == 2
    err = capsys.readouterr().err
    assert err == (f"error: no gRPC storage proxy answers at 127.0.0.1:{port} within 1 s: start "
                   "optuna.storages.run_grpc_proxy_server there (docs/clusters.md), or check --storage\n")
    assert not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_a_study_runs_through_a_grpc_proxy_in_front_of_a_storage(root_and_tmp, capsys) -> None:
    """Two workers of ``tune --storage grpc://`` through a real proxy server (docs/clusters.md's command, a
    subprocess on loopback) in front of a SQLite storage: each configuration evaluated once, read back through
    the storage itself and by ``report`` through the proxy. Only subprocesses speak gRPC here: grpcio's fork
    handlers (1.68, the lower bound) can abort a process that forks after it used a channel, as pytest's does to
    start ``tune`` (seen in CI: a worker killed by SIGSEGV in cygrpc, then xdist waiting forever)."""
    root, tmp = root_and_tmp
    database, port = tmp / "behind.db", free_port()
    optuna.storages.RDBStorage(f"sqlite:///{database}")  # the tables, as a first start of the server would
    command = proxy_command().replace("python", sys.executable, 1).replace("port=13000", f"port={port}")
    server = subprocess.Popen(["bash", "-c", command], env={**os.environ, "MTMOE_PROXIED": f"sqlite:///{database}"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"grpc://127.0.0.1:{port}"
        listening(port)
        code, out, err = run_tune(tune_args(url, root, tmp / "runs", *TINY, "--pack", "1", "--workers", "2",
                                            name="proxied"), tmp, root, "proxied")
        assert code == 0 and "Traceback" not in err, err[-3000:]
        trials = trials_of(f"sqlite:///{database}", "proxied")
        assert_each_config_once(trials, 3)
        assert all("heartbeat" in t.user_attrs for t in trials)  # the proxy has no Optuna heartbeats: the attribute
        code, out, err = run_tune(["report", "--data", "movielens-100k", "--storage", url, "--out",
                                   str(tmp / "report")], tmp, root, "report")
        assert code == 0 and "topk" in out, err[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=30)


def listening(port: int, timeout: float = 60) -> None:
    """Wait until a server accepts TCP connections on loopback ``port`` (without a gRPC channel in this process)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


#: What the clusters set in the recipes' environment (a Secret's URL, Slurm's and Kubernetes' job indices).
RECIPE_ENV = {"PATH": "/usr/bin:/bin", "MTMOE_STORAGE": "postgresql://mtmoe@db.cluster/studies",
              "SLURM_ARRAY_TASK_ID": "3", "JOB_COMPLETION_INDEX": "3", "SLURM_CPUS_PER_TASK": "8"}


def strings(node) -> list[str]:
    """Every string in a parsed YAML document."""
    if isinstance(node, dict):
        return [text for value in node.values() for text in strings(value)]
    if isinstance(node, list):
        return [text for value in node for text in strings(value)]
    return [node] if isinstance(node, str) else []


def recipe_commands() -> list[str]:
    """Every ``python -m mtmoe tune`` command of docs/clusters.md: its bash blocks' lines (continuations joined)
    and its YAML manifests' strings."""
    text = CLUSTERS.read_text()
    lines = [line for block in code_blocks(text, "bash") for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    lines += [text for block in code_blocks(text, "yaml") for doc in yaml.safe_load_all(block) for text in strings(doc)]
    return [line[line.index("python -m mtmoe tune"):] for line in lines if "python -m mtmoe tune" in line]


def proxy_command() -> str:
    """docs/clusters.md's line that starts the gRPC proxy server."""
    return next(line for block in code_blocks(CLUSTERS.read_text(), "bash") for line in block.splitlines()
                if "run_grpc_proxy_server" in line)


def test_the_cluster_recipes_parse() -> None:
    """The Slurm script is bash (``bash -n``), the Kubernetes manifests YAML with a Job of as many pods as it runs
    at once, and each ``tune`` command of them parses as ``tune`` parses its flags (shell variables as values)."""
    text = CLUSTERS.read_text()
    scripts = code_blocks(text, "bash")
    assert scripts and all(subprocess.run(["bash", "-n"], input=s, text=True).returncode == 0 for s in scripts)
    documents = [doc for block in code_blocks(text, "yaml") for doc in yaml.safe_load_all(block) if doc]
    jobs = [doc for doc in documents if doc["kind"] == "Job"]
    assert jobs and all(job["spec"]["parallelism"] >= 2 for job in jobs)
    commands = recipe_commands()
    assert len(commands) >= 3
    for command in commands:
        words = shell_words(command.removeprefix("python -m mtmoe "), RECIPE_ENV)
        args, overrides = parse_tune_args(words[1:])
        assert args.gate and args.data, command
        storage_module.check_url(args.storage)  # a storage URL tune takes
        assert all(arg.startswith("--") or not arg.startswith("-") for arg in overrides)
