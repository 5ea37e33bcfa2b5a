"""Every key of a run config with its value, its file's default and a one-line doc:
``python -m trainer --config FILE --print_config``.

The docs are the comments of the config files themselves (the comment above an
assignment such as ``config.optimizer.b1 = 0.9``, or at the end of its line, and
likewise for the keywords of ``ConfigDict(dict(...))`` and ``data_config(...)``), so
they cannot drift from the code that sets the keys. A key without a comment of its
own takes its section's (``mesh.axes.data`` that of ``mesh.axes``).
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

import ml_collections

from trainer.workdir import run_config

# The function of configs/common.py whose returned keywords are the ``data`` section's.
_DATA_SECTION = "data_config"
# Config files' functions named ``<section>_section`` build that section.
_SECTION = "_section"


def key_docs(path: str) -> dict[str, str]:
    """``{"a.b": "one line"}`` from the comments of the config file ``path`` and of the
    config modules it imports (where a key is defined comes first: common.py's doc
    of ``optimizer.b1`` wins over a variant's comment on changing it)."""
    docs: dict[str, str] = {}
    for file in reversed(_files(os.path.abspath(path))):
        for key, doc in _file_docs(file).items():
            docs.setdefault(key, doc)
    return docs


def doc_of(key: str, docs: dict[str, str]) -> str:
    """``key``'s doc, else that of the nearest section above it that has one ("")."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        if doc := docs.get(".".join(parts[:end])):
            return doc
    return ""


def render(config: ml_collections.ConfigDict, defaults: dict, source: str) -> str:
    """The ``--print_config`` text: a header, then one line per key of ``config``,
    ``key = value  # doc``, with ``(file: default)`` where the variant or a
    ``--config.`` flag changed the file's default (``defaults``, flat)."""

    docs = key_docs(source.partition(":")[0])
    values = run_config.flat_config(config)
    lines = [
        f"# {len(values)} keys of --config {source}: key = value (file: its default, where "
        "the variant or a --config. flag changed it)  # what it does"
    ]
    for key, value in values.items():
        default = (
            f" (file: {defaults[key]!r})" if key in defaults and defaults[key] != value else ""
        )
        new = "" if key in defaults else " (not in the file's defaults)"
        doc = doc_of(key, docs)
        lines.append(f"{key} = {value!r}{default}{new}" + (f"  # {doc}" if doc else ""))
    return "\n".join(lines) + "\n"


def _files(path: str) -> list[str]:
    """``path`` and, after it, the modules of its own package it imports (recursively)."""
    out, todo = [], [path]
    while todo:
        file = todo.pop(0)
        if file in out or not os.path.isfile(file):
            continue
        out.append(file)
        package = os.path.basename(os.path.dirname(file))
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == package:
                todo += [os.path.join(os.path.dirname(file), f"{a.name}.py") for a in node.names]
    return out


def _file_docs(file: str) -> dict[str, str]:
    with open(file, encoding="utf-8") as f:
        source = f.read()
    comments = {
        token.start[0]: (token.start[1], token.string.lstrip("#").strip())
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    docs: dict[str, str] = {}

    def comment(first: int, last: int) -> str:
        # A comment at the end of the line, else the block of comment lines right above.
        for line in (last, first):
            if line in comments and lines[line - 1][: comments[line][0]].strip():
                return comments[line][1]
        block, line = [], first - 1
        while line in comments and not lines[line - 1][: comments[line][0]].strip():
            block.insert(0, comments[line][1])
            line -= 1
        return _one_line(" ".join(block))

    def keywords(value: ast.expr, prefix: str, line: int) -> None:
        # The keys of a call's keywords or a dict's entries under ``prefix``; one on the
        # line of its section (``line``) shares the section's comment.
        entries = []
        if isinstance(value, ast.Call):
            for arg in value.args:
                keywords(arg, prefix, line)
            entries = [(kw.arg, kw.lineno, kw.value) for kw in value.keywords if kw.arg]
        elif isinstance(value, ast.Dict):
            entries = [
                (k.value, k.lineno, v)
                for k, v in zip(value.keys, value.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            ]
        for name, first, entry in entries:
            key = f"{prefix}.{name}"
            if first != line and (doc := comment(first, entry.end_lineno)):
                docs.setdefault(key, doc)
            keywords(entry, key, first)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == _DATA_SECTION:
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    keywords(ret.value, "data", ret.lineno)
        if isinstance(node, ast.FunctionDef) and node.name.endswith(_SECTION):
            # ``def model_section(): model = ConfigDict(dict(...))``: the keywords of a
            # section built by a function of its name are that section's keys.
            section = node.name.removesuffix(_SECTION)
            for assign in ast.walk(node):
                if isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call):
                    keywords(assign.value, section, assign.lineno)
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            key = _config_key(target)
            if key is None:
                continue
            if doc := comment(node.lineno, node.end_lineno):
                docs.setdefault(key, doc)
            keywords(node.value, key, node.lineno)
    return docs


def _config_key(target: ast.expr) -> str | None:
    """``"a.b"`` for the target ``config.a.b`` (or ``config["a"].b``), else None."""
    parts = []
    while True:
        if isinstance(target, ast.Attribute):
            parts.insert(0, target.attr)
            target = target.value
        elif isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
            parts.insert(0, str(target.slice.value))
            target = target.value
        else:
            break
    if isinstance(target, ast.Name) and target.id == "config" and parts:
        return ".".join(parts)
    return None


def _one_line(text: str) -> str:
    """The first sentence of ``text`` (a doc is one line)."""
    return re.split(r"(?<=\.)\s+(?=[A-Z(])", text.strip(), maxsplit=1)[0] if text else ""
