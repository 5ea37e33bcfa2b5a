"""Command-line plumbing shared by the commands: flags, configs and one-line errors.

Turns the ways a user can get the input wrong into one line on stderr and a
non-zero exit (:func:`fail`, :func:`clear_errors`); the process itself is set up
by :mod:`trainer.command.process`.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import importlib.util
import inspect
import os
import re
import sys
import textwrap
from collections.abc import Iterator

import ml_collections
from absl import flags

from trainer.errors import UserError
from trainer.workdir import run_config

EXIT_USAGE = 2
EXIT_ERROR = 1


def fail(
    message: str, code: int = EXIT_USAGE, *, last_words: bool = False, at_once: bool = False
) -> None:
    """Prints ``error: message`` (one line) to stderr and exits.

    Args:
      last_words: nothing this process prints afterwards reaches the user (for
        a failed save, whose other writers die printing tracebacks at exit).
      at_once: leave without Python's exit (no atexit handlers, no joining of
        threads that wait for a dead peer).
    """
    from trainer.command import signals  # noqa: PLC0415  (imports nothing heavy)

    if (handling := signals.current()) is not None:
        handling.wait_if_exiting()  # a stop-now under way says the last line
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    if last_words:
        signals.silence()
    if at_once:
        os._exit(code)
    sys.exit(code)


def reject_arguments(argv: list[str]) -> None:
    """Exits with a usage error if anything but flags was given (argv[0] is the program)."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")


def config_overrides(argv: list[str]) -> list[str]:
    """The keys of ``--config.a.b=value`` arguments."""
    return [m.group(1) for a in argv if (m := re.match(r"--config\.([\w.]+)", a))]


def config_files(argv: list[str]) -> list[str]:
    """The values of ``--config`` (``--config X`` or ``--config=X``)."""
    files = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def load_config(value: str) -> ml_collections.ConfigDict:
    """The config ``path[:variant]`` names, loaded the way ml_collections' config flag
    loads it: the file's ``get_config(variant)`` (``get_config()`` without a variant).

    Raises:
      UserError: the file is missing, or its ``get_config`` raised (its message kept).
    """
    path, colon, variant = value.partition(":")
    if not os.path.isfile(path):
        raise UserError(f"--config {value}: no such file {path!r}")
    spec = importlib.util.spec_from_file_location("config_file", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config(variant) if colon else module.get_config()
    except UserError as e:  # a mistake the project's code named (a model directory's)
        raise UserError(f"--config {value}: {e}") from None
    except Exception as e:  # noqa: BLE001  (whatever the config file raised: the user's)
        raise UserError(f"--config {value}: {type(e).__name__}: {e}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UserError(
            f"--config {value}: get_config() returned {type(config).__name__} "
            f"{str(config)[:40]!r}, not an ml_collections.ConfigDict"
        )
    return config


def check_keys(config: ml_collections.ConfigDict, keys: list[str]) -> None:
    """Fails on the first of ``keys`` (``"a.b"`` of ``--config.a.b=...``) that
    ``config`` does not have, suggesting the nearest key at that level."""
    for key in keys:
        node: object = config
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if isinstance(node, ml_collections.ConfigDict) and part in node:
                node = node[part]
                continue
            prefix = ".".join(parts[:depth])
            message = f"unknown config key '{key}' (from --config.{key}=...)"
            if isinstance(node, ml_collections.ConfigDict):
                near = difflib.get_close_matches(part, list(node.keys()), n=1)
                if near:
                    message += f"; did you mean '{prefix + '.' if prefix else ''}{near[0]}'?"
            fail(message)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors (for ``app.run(flags_parser=...)``).

    The config files are loaded and every ``--config.a.b`` checked against them
    first: ml_collections loads them lazily, and reports a mistake as a traceback
    or an error naming only the last part of the key. A comma-separated list given to
    a key whose value is a tuple of strings (``data.train_files``, as text_pairs'
    configs have it) is taken as that tuple, as a string key takes it.
    """
    overrides = config_overrides(argv)
    configs = []
    for value in config_files(argv):
        try:
            configs.append(load_config(value))
        except UserError as e:
            fail(str(e))
        check_keys(configs[-1], overrides)
    for each in configs:
        argv = comma_lists(each, argv)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(e))
    return []


def comma_lists(config: ml_collections.ConfigDict, argv: list[str]) -> list[str]:
    """``argv`` with each ``--config.KEY=a,b`` whose key holds a tuple (or list) of
    strings in ``config`` written as the tuple ``('a', 'b')`` that ml_collections
    parses (it reads a bare ``a,b`` as Python, and fails)."""
    out = []
    for arg in argv:
        match = re.fullmatch(r"--config\.([\w.]+)=(.*)", arg, re.S)
        if match and _holds_strings(config, match[1]) and match[2][:1] not in ("(", "[", "'", '"'):
            items = tuple(part.strip() for part in match[2].split(",") if part.strip())
            arg = f"--config.{match[1]}={items!r}"
        out.append(arg)
    return out


def _holds_strings(config: ml_collections.ConfigDict, key: str) -> bool:
    node: object = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, tuple | list) and all(isinstance(item, str) for item in node)


@contextlib.contextmanager
def clear_errors() -> Iterator[None]:
    """Reports the errors a user can cause as one line: :class:`UserError`, and the
    file-system errors of a path (a file where a directory should be, a full disk,
    permissions: :func:`trainer.workdir.storage.explain`). Anything else is a bug
    and keeps its traceback."""
    from trainer.workdir import storage  # noqa: PLC0415  (etils: not for --help)

    try:
        yield
    except UserError as e:
        fail(str(e), EXIT_ERROR, last_words=e.last_words, at_once=e.exit_at_once)
    except OSError as e:
        # A missing file the error does not name is more likely a bug than a path.
        if e.errno not in storage.PATH_ERRNOS or (e.errno == errno.ENOENT and not e.filename):
            raise
        fail(storage.explain(e), EXIT_ERROR)


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def help_requested(argv: list[str]) -> bool:
    """Whether ``argv`` asks for help (before any other flag is checked)."""
    return any(arg in HELP_FLAGS for arg in argv[1:])


def _plain(text: str) -> str:
    """A docstring as a terminal shows it: no Sphinx roles, no double backticks."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def help_text(module, program: str) -> str:
    """The help of a command: its docstring (without its ``Example:`` part), its
    flags with their help and defaults, then the docstring's ``Example:`` part.

    Args:
      module: the command's module (its docstring, and the flags it defined).
      program: how the user runs it, e.g. ``python -m trainer.evaluate``.
    """
    doc = _plain(inspect.cleandoc(module.__doc__ or program))
    body, _, example = doc.partition("\nExample:")
    first, _, rest = body.partition("\n\n")
    if first.startswith(program):  # the docstring opens with the usage (one paragraph)
        usage, body = " ".join(first.split()).rstrip("."), rest
    else:
        usage = f"{program} [flags]"
    defined = flags.FLAGS.flags_by_module_dict().get(sys.argv[0], [])
    lines = [f"usage: {usage}", "", body.strip(), ""]
    if defined:
        lines.append("flags:")
        for flag in sorted(defined, key=lambda f: f.name):
            if flag.default is None:
                default = " (required)" if _required(flag) else ""
            elif flag.default == [] or flag.default == "":
                default = ""
            else:
                default = f" (default: {flag.default_as_str.strip(chr(39))})"
            lines += textwrap.wrap(
                f"--{flag.name}: {_plain(flag.help)}{default}",
                width=88,
                initial_indent="  ",
                subsequent_indent="      ",
            )
        lines.append("")
    lines.append("--help: show this help and exit.")
    if example.strip():
        lines += ["", "example:", *("  " + line for line in example.strip().splitlines())]
    return "\n".join(lines) + "\n"


def _required(flag: flags.Flag) -> bool:
    # absl's mark_flag_as_required is a validator with this message, and no attribute.
    return any("must have a value other than None" in v.message for v in flag.validators)


LIST_CONFIGS = ("--list_configs",)


def list_configs() -> str:
    """The configs shipped in ``configs/``: each file, the first line of its
    docstring, and its variants (``VARIANTS``, then those that take a value:
    ``OPTIONS``, e.g. ``{"hf=DIR": "..."}``) with one line each."""
    import configs  # noqa: PLC0415  (only for the listing: configs import nothing heavy)

    lines = ["configs (python -m trainer --config configs/FILE.py[:VARIANT[,VARIANT]]):"]
    (directory,) = configs.__path__
    for name in sorted(os.listdir(directory)):
        stem = name.removesuffix(".py")
        if not name.endswith(".py") or stem in ("__init__", "common"):
            continue
        module = importlib.import_module(f"configs.{stem}")
        summary = (module.__doc__ or "").strip().splitlines()[0]
        lines += ["", f"  configs/{name}", f"      {_plain(summary)}"]
        variants = {**getattr(module, "VARIANTS", {}), **getattr(module, "OPTIONS", {})}
        lines += [f"      :{v:<14}{text}" for v, text in variants.items()]
    return "\n".join(lines) + "\n"


def describe_config(config: ml_collections.ConfigDict, source: str) -> str:
    """The config block a run starts with: the keys of ``config`` whose values differ
    from the defaults of its file (``get_config()`` of ``source``'s path: the
    variant's changes and the command line's), a few per line."""
    defaults = run_config.flat_config(load_config(source.partition(":")[0]))
    changed = [
        f"{key}={value!r}"
        for key, value in run_config.flat_config(config).items()
        if key not in defaults or defaults[key] != value
    ]
    head = f"config {source}: " + (
        f"{len(changed)} keys differ from the file's defaults" if changed else "the file's defaults"
    )
    return "\n".join(
        [
            head,
            *textwrap.wrap(
                "  ".join(changed),
                96,
                initial_indent="  ",
                subsequent_indent="  ",
                break_long_words=False,
                break_on_hyphens=False,
            ),
        ]
    )
