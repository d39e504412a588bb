"""Command-line flags generated from the settings models, so that a flag can never name a setting that is not there.

Each leaf of a settings section becomes ``--field-name`` (underscores as dashes), with the field's type, its
description as help, and no default: a flag that is not given leaves the lower layers (file, environment) alone.
A few fields keep the shorter names users already type (:data:`RENAMED`). ``bool`` fields get ``--x/--no-x``,
lists take several values, ``Literal`` types become choices, and ``X | None`` takes an ``X``.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from noloco_node.config.settings import Settings

SettingPath = tuple[str, ...]

# Settings whose flag is not simply the field's name: names users know from the first releases.
RENAMED: dict[SettingPath, str] = {
    ("train", "model_size"): "--model",
    ("train", "total_steps"): "--steps",
    ("data", "source"): "--data",
}
# Settings with no flag: each has a dedicated option of its own command.
NOT_FLAGS: frozenset[SettingPath] = frozenset()


@dataclass(frozen=True)
class Flag:
    """One flag and the setting it sets."""

    name: str
    path: SettingPath
    kind: Any  # the argparse ``type``
    help: str
    nargs: str | None = None
    choices: tuple[Any, ...] | None = None
    boolean: bool = False

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def _section_model(path: SettingPath) -> type[BaseModel]:
    model: type[BaseModel] = Settings
    for part in path:
        annotation = model.model_fields[part].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    return model


def _flag(path: SettingPath, info: Any) -> Flag:
    annotation = info.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        annotation, origin, args = args[0], typing.get_origin(args[0]), list(typing.get_args(args[0]))
    name = RENAMED.get(path, "--" + path[-1].replace("_", "-"))
    help_text = (info.description or path[-1].replace("_", " ")).rstrip(".").replace("%", "%%")  # argparse formats it
    if annotation is bool:
        return Flag(name, path, None, help_text, boolean=True)
    if origin is list:
        return Flag(name, path, args[0] if args else str, help_text, nargs="*")
    if origin is Literal:
        return Flag(name, path, type(args[0]), help_text, choices=tuple(args))
    if annotation in (int, float, str, Path):
        return Flag(name, path, annotation, help_text)
    raise TypeError(f"no flag for setting {'.'.join(path)} of type {annotation!r}")


def section_flags(*sections: str) -> dict[str, Flag]:
    """The flags of every leaf setting of these sections (``"train"``, ``"node.security"``, ...), by flag name."""
    flags: dict[str, Flag] = {}
    for section in sections:
        path = tuple(section.split("."))
        for field, info in _section_model(path).model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                continue  # a subsection: listed on its own
            if (*path, field) in NOT_FLAGS:
                continue
            flag = _flag((*path, field), info)
            if flag.name in flags:
                raise ValueError(f"two settings would share the flag {flag.name}")
            flags[flag.name] = flag
    return flags


TRAIN_FLAGS = section_flags("train", "outer", "data")
NODE_FLAGS = section_flags("node", "node.security")
RL_FLAGS = section_flags("rl")


def subset(flags: Mapping[str, Flag], names: Iterable[str]) -> dict[str, Flag]:
    return {name: flags[name] for name in names}


def add_flags(parser: argparse.ArgumentParser, flags: Mapping[str, Flag]) -> None:
    for flag in flags.values():
        if flag.boolean:
            parser.add_argument(
                flag.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=flag.help
            )
        else:
            parser.add_argument(
                flag.name,
                type=flag.kind,
                nargs=flag.nargs,
                choices=flag.choices,
                default=argparse.SUPPRESS,
                help=flag.help,
            )


def given_settings(args: argparse.Namespace, flags: Mapping[str, Flag]) -> dict[str, Any]:
    """The flags the user gave, nested like the settings tree (``{"node": {"security": {...}}, "train": {...}}``)."""
    given: dict[str, Any] = {}
    for flag in flags.values():
        if hasattr(args, flag.dest):
            tree = given
            for part in flag.path[:-1]:
                tree = tree.setdefault(part, {})
            tree[flag.path[-1]] = getattr(args, flag.dest)
    return given


def flag_names(flags: Mapping[str, Flag]) -> dict[SettingPath, str]:
    """Setting path -> ``flag --name``, for messages that say which layer set a bad value."""
    return {flag.path: f"flag {flag.name}" for flag in flags.values()}


def as_arguments(args: argparse.Namespace, flags: Mapping[str, Flag]) -> list[str]:
    """The given flags written back as command-line arguments (a launcher passes them on to its nodes)."""
    out: list[str] = []
    for flag in flags.values():
        if not hasattr(args, flag.dest):
            continue
        value = getattr(args, flag.dest)
        if flag.boolean:
            out.append(flag.name if value else "--no-" + flag.name[2:])
        elif flag.nargs:
            out += [flag.name, *(str(v) for v in value)]
        else:
            out += [flag.name, str(value)]
    return out
