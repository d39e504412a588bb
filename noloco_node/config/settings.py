"""The effective settings of a node: a TOML or YAML file, then ``NOLOCO_*`` variables, then command-line flags.

One pydantic tree, :class:`Settings`, holds every section of models.py: ``node`` (pairing, network, status, paths,
with ``node.security``), ``train`` (model size and the inner phase), ``outer`` and ``data``. Layers are applied
in that order, later ones winning, and :func:`resolve` remembers where every value came from, so that
``noloco-node config show`` can say it. A variable is named by its path: ``NOLOCO_TRAIN__LR``,
``NOLOCO_NODE__SECURITY__NORM_BOUND``; lists take JSON (``["a", "b"]``) or commas. Unknown keys in the file and
unknown ``NOLOCO_*`` variables are errors that name them; bad values are reported with the field and the layer
that set it; a secret never appears (the swarm secret is not a setting at all: auth.py reads it).
"""

from __future__ import annotations

import json
import os
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from noloco_node.config.models import _SENSITIVE_WORDS, DataConfig, OuterConfig, TrainConfig
from noloco_node.config.node_config import KNOWN_ENVIRONMENT, NodeConfig
from noloco_node.config.rl_config import RolloutConfig
from noloco_node.errors import NolocoError

# Where the swarm secret comes from (security/auth.py reads it): never a setting, so never in a settings file.
SECRET_ENV = "NOLOCO_SWARM_SECRET"
SECRET_FILE_ENV = "NOLOCO_SWARM_SECRET_FILE"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the tomli backport has the same API
    import tomli as tomllib

ENV_PREFIX = "NOLOCO_"
Path_ = tuple[str, ...]


class SettingsError(NolocoError):
    """A settings file or variable that cannot be used; the message names it."""


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: NodeConfig = Field(default_factory=NodeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rl: RolloutConfig = Field(default_factory=RolloutConfig)


def leaf_fields(model: type[BaseModel] = Settings, prefix: Path_ = ()) -> dict[Path_, Any]:
    """Every settable leaf of the tree, by path, with its pydantic FieldInfo."""
    leaves: dict[Path_, Any] = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            leaves.update(leaf_fields(annotation, (*prefix, name)))
        else:
            leaves[(*prefix, name)] = info
    return leaves


def env_name(path: Path_) -> str:
    return ENV_PREFIX + "__".join(part.upper() for part in path)


def _is_list(info: Any) -> bool:
    annotation = info.annotation
    return typing.get_origin(annotation) is list or any(
        typing.get_origin(arg) is list for arg in typing.get_args(annotation)
    )


def _env_value(raw: str, info: Any) -> Any:
    text = raw.strip()
    if text.startswith(("[", "{")):
        try:
            return json.loads(text)
        except ValueError:
            return raw
    if _is_list(info):
        return [item for item in (part.strip() for part in text.replace(",", " ").split()) if item]
    if text == "" and not info.is_required() and info.default is None:
        return None
    return raw


def _set(tree: dict[str, Any], path: Path_, value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def env_layer(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[Path_, str]]:
    """Settings from ``NOLOCO_<SECTION>__<FIELD>`` variables; any other unknown NOLOCO_* variable is an error."""
    leaves = {env_name(path): (path, info) for path, info in leaf_fields().items()}
    layer: dict[str, Any] = {}
    sources: dict[Path_, str] = {}
    unknown = []
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in KNOWN_ENVIRONMENT:
            continue
        if name not in leaves:
            unknown.append(name)
            continue
        path, info = leaves[name]
        _set(layer, path, _env_value(raw, info))
        sources[path] = f"${name}"
    if unknown:
        raise SettingsError(
            f"unknown environment variable {', '.join(sorted(unknown))}: settings are NOLOCO_<SECTION>__<FIELD> "
            f"(e.g. NOLOCO_TRAIN__LR, NOLOCO_NODE__MODE); others known: {', '.join(KNOWN_ENVIRONMENT)}"
        )
    return layer, sources


def file_layer(path: Path) -> dict[str, Any]:
    """A TOML (.toml) or YAML (.yaml/.yml) settings file as a nested dict; sections are checked by the model."""
    try:
        text = path.read_text()
    except OSError as error:
        raise SettingsError(f"cannot read settings file {path}: {error.strerror}") from None
    try:
        if path.suffix == ".toml":
            content: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            content = yaml.safe_load(text) or {}
        else:
            raise SettingsError(f"settings file {path}: use .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        raise SettingsError(f"settings file {path} does not parse: {error}") from None
    if not isinstance(content, dict):
        raise SettingsError(f"settings file {path} must hold a table of sections (node, train, outer, data)")
    return content


def _merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _paths(tree: Mapping[str, Any], prefix: Path_ = ()) -> list[Path_]:
    found: list[Path_] = []
    for key, value in tree.items():
        if isinstance(value, Mapping) and (*prefix, key) not in leaf_fields():
            found += _paths(value, (*prefix, key))
        else:
            found.append((*prefix, key))
    return found


def resolve(
    config_file: Path | None,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
    *,
    flag_names: Mapping[Path_, str] | None = None,
) -> tuple[Settings, dict[Path_, str]]:
    """The settings of file < environment < flags, and where each non-default value came from.

    ``flags`` is nested like the file (``{"train": {"lr": 0.001}}``); ``flag_names`` maps paths to the flag that
    set them, for messages."""
    sources: dict[Path_, str] = {}
    tree: dict[str, Any] = {}
    if config_file is not None:
        from_file = file_layer(config_file)
        tree = _merge(tree, from_file)
        sources.update({path: f"file {config_file}" for path in _paths(from_file)})
    from_env, env_sources = env_layer(environ)
    tree = _merge(tree, from_env)
    sources.update(env_sources)
    tree = _merge(tree, flags)
    sources.update({path: (flag_names or {}).get(path, "flag") for path in _paths(flags)})
    try:
        return Settings(**tree), sources
    except ValidationError as error:
        raise SettingsError(describe_errors(error, sources)) from None


def describe_errors(error: ValidationError, sources: Mapping[Path_, str]) -> str:
    """One line per bad field: its dotted name, what is wrong, the value (unless sensitive) and the layer."""
    lines = []
    for item in error.errors():
        path = tuple(str(part) for part in item["loc"])
        name = ".".join(path) or "settings"
        value = item.get("input")
        sensitive = isinstance(value, dict) or any(word in name.lower() for word in _SENSITIVE_WORDS)
        shown = "" if sensitive else f" (got {value!r})"
        origin = next((sources[path[:n]] for n in range(len(path), 0, -1) if path[:n] in sources), None)
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown setting {name}{f' in {origin}' if origin else ''}")
        else:
            lines.append(f"invalid setting {name}: {item['msg']}{shown}{f' from {origin}' if origin else ''}")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string


def _sections(model: type[BaseModel], prefix: Path_ = ()) -> list[tuple[Path_, type[BaseModel]]]:
    found = [(prefix, model)] if prefix else []
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            found += _sections(info.annotation, (*prefix, name))
    return found


def show(settings: Settings, sources: Mapping[Path_, str], environ: Mapping[str, str] | None = None) -> str:
    """The effective settings as TOML, each value with where it came from; secrets are never shown."""
    env = os.environ if environ is None else environ
    secret_from = (
        f"the file {env[SECRET_FILE_ENV]} (${SECRET_FILE_ENV})"
        if env.get(SECRET_FILE_ENV)
        else f"${SECRET_ENV} (value not shown)"
        if env.get(SECRET_ENV)
        else None
    )
    if settings.node.security.secret_file is not None:
        secret_from = f"the file {settings.node.security.secret_file}"
    lines = [
        "# noloco-node effective settings: file < NOLOCO_* environment < flags",
        f"# swarm secret: {'from ' + secret_from if secret_from else 'none (an open run)'}",
    ]
    data = settings.model_dump(mode="json")
    for path, model in _sections(Settings):
        section = data
        for part in path:
            section = section[part]
        lines += ["", f"[{'.'.join(path)}]"]
        for name in model.model_fields:
            annotation = model.model_fields[name].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                continue
            value, origin = section[name], sources.get((*path, name), "default")
            if value is None:
                lines.append(f"# {name} = (unset)  # {origin}")
            else:
                lines.append(f"{name} = {_toml_value(value)}  # {origin}")
    return "\n".join(lines) + "\n"


def example() -> str:
    """A commented settings file: every setting with its description and default, all commented out, so the file
    as written changes nothing and a user uncomments what they need."""
    lines = [
        "# noloco-node settings (TOML). Precedence: this file < NOLOCO_<SECTION>__<FIELD> variables < flags.",
        "# Every line is commented out: the values shown are the defaults. The swarm secret is never set here:",
        f"# use node.security.secret_file, ${SECRET_FILE_ENV} or ${SECRET_ENV}.",
    ]
    defaults = Settings().model_dump(mode="json")
    for path, model in _sections(Settings):
        section = defaults
        for part in path:
            section = section[part]
        lines += ["", f"[{'.'.join(path)}]"]
        if model.__doc__:
            lines.append(f"# {model.__doc__.strip().splitlines()[0]}")
        for name, info in model.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                continue
            if info.description:
                lines.append(f"# {info.description}")
            value = section[name]
            lines.append(f"# {name} = {_toml_value(value)}" if value is not None else f"# {name} =  (unset)")
    return "\n".join(lines) + "\n"
