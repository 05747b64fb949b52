"""The keys a command's ``--help`` lists: every key of its composed config, with its default and
meaning.

A key's meaning comes from the comment its YAML line carries or, for the keys a section's config
class adds (the policy, env and algorithm families list few of their keys in YAML), from the
``Attributes:`` section of the class's docstring (Google style, read along the class's bases).
Pure: reads YAML files and imports config classes, starts nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

#: The length past which a meaning is cut (at a word) in ``--help``.
MEANING_WIDTH = 110


class Key(NamedTuple):
    """One key of a config: its dotted name, default as YAML writes it, and meaning."""

    name: str
    default: str
    meaning: str

    def line(self) -> str:
        return f"  {self.name} = {self.default}" + (f"  ({self.meaning})" if self.meaning else "")


def yaml_keys(config_file: Path, prefix: str = "") -> list[Key]:
    """The leaf keys a YAML config file sets (not its ``defaults`` list), in file order, as
    ``prefix + section.key`` with the value as written and the line's ``# comment``.

    Also yields the mappings that hold them (default ``""``), so that a class field holding a
    nested config is known to be listed.
    """
    keys, stack = [], []  # stack: (indent, key) of the enclosing mappings
    for raw in config_file.read_text().splitlines():
        text = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not text.strip() or text.lstrip().startswith("-") or ":" not in text:
            continue
        indent = len(text) - len(text.lstrip())
        key, _, value = text.strip().partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if key == "defaults" and not stack:
            stack.append((indent, None))
            continue
        if any(k is None for _, k in stack):  # inside the defaults list
            continue
        comment = raw.split(" # ", 1)[1].strip() if " # " in raw else ""
        name = prefix + ".".join([k for _, k in stack] + [key])
        keys.append(Key(name, value.strip(), comment))
        if not value.strip():
            stack.append((indent, key))
    return keys


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its description in the ``Attributes:`` sections of ``cls`` and its bases
    (a subclass's description wins; ``a, b: text`` describes both)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_attributes(klass.__dict__.get("__doc__") or ""))
    return docs


def _attributes(doc: str) -> dict[str, str]:
    """``name: text`` entries of every block under a heading line that ends with ``:``
    (``Attributes:``, or headings such as ``Architecture:`` that group them; ``a, b: text``
    and ``a / b: text`` describe both)."""
    lines = [line for line in inspect.cleandoc(doc).splitlines() if line.strip()]
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    entry_indent = None
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        head = re.match(r"^(\w+(?:\s*[,/]\s*\w+)*)\s*:\s*(.*)$", line.strip())
        if entry_indent is not None and indent == entry_indent and head:
            current = [head.group(2)]
            for name in re.split(r"[,/]", head.group(1)):
                entries[name.strip()] = current
        elif entry_indent is not None and indent > entry_indent and current is not None:
            current.append(line.strip())
        else:  # a heading opens a block when the next line is indented under it
            entry_indent = current = None
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if line.rstrip().endswith(":") and len(following) - len(following.lstrip()) > indent:
                entry_indent = len(following) - len(following.lstrip())
    return {name: " ".join(text).strip() for name, text in entries.items()}


def plain(text: str, width: int = MEANING_WIDTH) -> str:
    """``text`` without reStructuredText markup (````x```` -> ``x``, ``:class:`~a.B``` ->
    ``B``), cut after its first sentence and at ``width`` characters (at a word)."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = text.replace("``", "")
    sentence = re.split(r"(?<!e\.g)(?<!i\.e)(?<=[a-z0-9)])\. (?=[A-Z(])", text, maxsplit=1)[0]
    if sentence.endswith(".") and not sentence.endswith(".."):
        sentence = sentence[:-1]
    if len(sentence) > width:
        sentence = sentence[:width].rsplit(" ", 1)[0] + " ..."
    return sentence


def yaml_value(value: Any) -> str:
    """A default as the command line would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if value == "":
        return '""'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def class_keys(
    cls: type,
    section: str,
    defaults: dict[str, Any] | None = None,
    skip: frozenset = frozenset(),
    docs: dict[str, str] | None = None,
) -> Iterator[Key]:
    """The fields of the config dataclass ``cls`` as keys of ``section`` (defaults from the
    class, or from ``defaults``; meanings from its docstring, or from ``docs``), leaving out
    the names in ``skip``."""
    docs = {**(docs or {}), **attribute_docs(cls)}
    given = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_") or not f.init:
            continue
        if f.name in given:
            value = yaml_value(given[f.name])
        elif f.default is not dataclasses.MISSING:
            value = yaml_value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            value = yaml_value(_plain_factory(f.default_factory()))
        else:
            value = "(required)"
        yield Key(f"{section}.{f.name}", value, plain(docs.get(f.name, "")))


def _plain_factory(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def section_keys(
    group_file: Path,
    section: str,
    cls: type | None,
    defaults: dict[str, Any] | None = None,
    docs: dict[str, str] | None = None,
) -> list[Key]:
    """The keys of ``section`` chosen as ``group_file``: those the file sets (its comments as
    meanings, else the class's or ``docs``), then the class's other fields."""
    listed = yaml_keys(group_file, section + ".")
    docs = {**(docs or {}), **(attribute_docs(cls) if cls is not None else {})}
    keys = [
        k._replace(meaning=k.meaning or plain(docs.get(k.name[len(section) + 1 :], "")))
        for k in listed
        # the mappings that hold other keys are not keys to set; the group choice sets name
        if k.default and k.name != f"{section}.name"
    ]
    if cls is not None:
        top = frozenset(k.name[len(section) + 1 :].split(".")[0] for k in listed)
        keys += class_keys(cls, section, defaults, skip=top, docs=docs)
    return keys
