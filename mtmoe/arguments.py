"""The ``fit``/``validate``/``test`` command line before it is parsed, without torch or Lightning, so that a typo is
answered at once: the shortcuts (:func:`translate_shortcuts`) and the settings the training engine does not honour
(:data:`UNSUPPORTED_TRAINER_SETTINGS`), checked by :func:`check_arguments` before the heavy imports and again, for
configuration files and the Python API, on the parsed configuration (:func:`mtmoe.run_settings.check_trainer_settings`).
"""
from __future__ import annotations

from pathlib import Path

from mtmoe.data import dataset_path
from mtmoe.errors import UsageError
from mtmoe.gate_names import PLUS_PERM_EPOCHS, check_gate_name, gate_paths, split_gate_name

#: Trainer settings the training engine (``mtmoe.pack.engine``, for ``fit`` and every packed trial alike) does not
#: honour, with the value that is honoured and why: each is refused in one line unless it has that value, and left
#: out of ``fit --help``. Every other ``--trainer.*`` setting is honoured (the loop is Lightning's).
UNSUPPORTED_TRAINER_SETTINGS = {
    "fast_dev_run": (False, "use --trainer.limit_train_batches, limit_val_batches and limit_test_batches"),
    "min_epochs": (None, "each trial stops by its own early stopping"),
    "max_steps": (-1, "a trial's budget is --trainer.max_epochs"),
    "min_steps": (None, "each trial stops by its own early stopping"),
    "max_time": (None, "a trial's budget is --trainer.max_epochs"),
    "overfit_batches": (0.0, "use --trainer.limit_train_batches"),
    "val_check_interval": (None, "trials are validated at the end of epochs (--trainer.check_val_every_n_epoch)"),
    "accumulate_grad_batches": (1, "the engine's step is one batch, one update (use --data.batch_size)"),
    "gradient_clip_val": (None, "the paper's Adam has no clipping"),
    "gradient_clip_algorithm": (None, "the paper's Adam has no clipping"),
    "reload_dataloaders_every_n_epochs": (0, "the splits stay on the device"),
    "plugins": (None, "the engine trains in precision 32 or bf16-mixed on one device"),
}


#: The largest ``--seed_everything`` (numpy's, which Lightning seeds too).
MAX_SEED = 2**32 - 1


def unsupported_setting(key: str, value: object) -> str | None:
    """Why ``--trainer.KEY VALUE`` cannot run on the engine, or ``None`` if it can."""
    if key not in UNSUPPORTED_TRAINER_SETTINGS:
        return None
    honoured, why = UNSUPPORTED_TRAINER_SETTINGS[key]
    if value == honoured or (key == "val_check_interval" and value == 1.0):
        return None
    return f"--trainer.{key} {value} is not supported by mtmoe's training engine: {why}"


def _flag_values(argv: list[str], flags: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """``(index, flag, value)`` of each ``--flag VALUE`` or ``--flag=VALUE`` in ``argv`` whose flag is in ``flags``."""
    found = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            if not eq and i + 1 >= len(argv):
                raise UsageError(f"{flag} needs a value")
            found.append((i, flag, value if eq else argv[i + 1]))
    return found


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def attach_negative_numbers(argv: list[str]) -> list[str]:
    """``--model.lr -1e-3`` as ``--model.lr=-1e-3``: argparse takes a negative number in exponent notation (or
    ``-inf``) after an option for another option, and answers "expected one argument"."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and arg.startswith("-") and is_number(arg):
            out[-1] += "=" + arg
        else:
            out.append(arg)
    return out


def translate_shortcuts(argv: list[str]) -> list[str]:
    """``--gate NAME`` -> ``--model.gate CLASS``, ``--data NAME`` -> ``--data CLASS``; unknown names fail here, before
    torch is imported, and so do a "+" on a gate without local search and a ``module:Class`` that is no gate (both
    imported, :func:`mtmoe.gates.parse_gate_name`) and ``--model.perm_epochs`` with a gate named without "+" (it
    would make the "+" variant), and so does a ``--config`` file that cannot be read (:func:`check_config_file`).
    A negative number after a flag is attached to it (:func:`attach_negative_numbers`)."""
    argv = attach_negative_numbers(argv)
    for _, flag, path in _flag_values(argv, ("--config", "-c")):
        check_config_file(flag, path)
    shortcuts = _flag_values(argv, ("--gate", "--data"))
    gates = [(split_gate_name(value), value) for _, flag, value in shortcuts if flag == "--gate"]
    for _, value in gates:
        check_gate_name(value)
    datasets = {i: value if "." in value else dataset_path(value) for i, flag, value in shortcuts if flag == "--data"}
    if any(plus or ":" in value for (_, plus), value in gates):
        from mtmoe.gates import parse_gate_name  # the gate classes (torch): a class of the user's, is it permutable

        for _, value in gates:
            parse_gate_name(value)
    perm_epochs = any(a.startswith("--model.perm_epochs") for a in argv)
    out: list[str] = []
    skip = {i + 1 for i, _, _ in shortcuts if "=" not in argv[i]}
    for i, arg in enumerate(argv):
        if i in skip:
            continue
        if i in datasets:
            out.append(f"--data={datasets[i]}")
        elif arg.partition("=")[0] == "--gate":  # "NAME+": the gate with local search (E_perm = 5 unless given)
            (base, plus), value = gates.pop(0)
            out.append(f"--model.gate={gate_paths().get(base, base).replace(':', '.')}")  # or module:Class
            if perm_epochs and not plus:
                raise UsageError(f"--model.perm_epochs adds local search to {value}: pass --gate {value}+ for that, "
                                 f"or drop --model.perm_epochs")
            if plus and not perm_epochs:
                out.append(f"--model.perm_epochs={PLUS_PERM_EPOCHS}")
        else:
            out.append(underscored(arg))
    return out


def underscored(arg: str) -> str:
    """``--trainer.max-epochs=3`` -> ``--trainer.max_epochs=3``: a key is the name of a Python argument (of the
    Trainer, the model, the DataModule), with underscores; a hyphen is read as one, as ``tune``, ``report`` and
    ``bootstrap`` take either spelling of their own options (:class:`mtmoe.errors.OneLineParser`)."""
    flag, eq, value = arg.partition("=")
    return "--" + flag[2:].replace("-", "_") + eq + value if flag.startswith("--") else arg


def check_arguments(argv: list[str]) -> None:
    """What ``fit``/``validate``/``test`` arguments can get wrong without a model, before torch and Lightning are
    imported: the shortcuts' names, and trainer settings the engine does not honour given as flags."""
    translate_shortcuts(argv)
    flags = tuple(f"--trainer.{key}" for key in UNSUPPORTED_TRAINER_SETTINGS)
    for _, flag, value in _flag_values(argv, flags):
        import yaml  # as jsonargparse reads a value: "-1" -> -1, "null" -> None

        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        problem = unsupported_setting(flag.removeprefix("--trainer."), parsed)
        if problem:
            raise UsageError(problem)


def check_config_file(flag: str, path: str) -> None:
    """``--config PATH`` as one line unless it is a file of YAML settings (a mapping): no such file, a folder, no
    YAML, or YAML of something else (nothing). A mapping given inline (jsonargparse's other form) passes."""
    import yaml

    file = Path(path)
    if not file.is_file():
        try:
            inline = yaml.safe_load(path)
        except yaml.YAMLError:
            inline = None
        if isinstance(inline, dict) and not file.exists():
            return
        what = "is a folder" if file.is_dir() else "is no file"
        raise UsageError(f"{flag} {path} {what}: pass a YAML file of settings (python -m mtmoe fit ... "
                         "--print_config > run.yaml writes one)")
    try:
        document = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UsageError(f"{flag} {path} is not valid YAML ({getattr(error, 'problem', None) or error}{where}): "
                         "fix the file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"{flag} {path} cannot be read ({getattr(error, 'strerror', None) or error})") from None
    if not isinstance(document, dict):
        held = "nothing" if document is None else f"a YAML {type(document).__name__}"
        raise UsageError(f"{flag} {path} holds {held}, not settings: a mapping of trainer:, model:, data:, ... "
                         "(python -m mtmoe fit ... --print_config shows one)")
