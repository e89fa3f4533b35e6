"""The config machinery every section shares: the error type, field checks, YAML reading and typed construction.

A section's dataclass checks its fields with :func:`_check` in ``__post_init__``; :func:`build_config` builds
one from a mapping (a params file's section, ``--set`` overrides), coercing each YAML value to its field's type
and naming the source of a bad value. Reading whole params files is :mod:`rlhf_core.config.sections`'s.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import types
import typing
from typing import Any, TypeVar

import yaml

from rlhf_core.common.shown import shown


class ConfigError(ValueError):
    """A config value or key that cannot be used; the message names file, section and field."""


def _check(condition: bool, section: str, name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{section}.{name}: {message}")


T = TypeVar("T")


MAX_INT = 2 ** 63
"""Integers in a config stay below this in magnitude (what torch and numpy hold): a larger one is refused."""

def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Coerce a YAML value to a dataclass field's annotated type, or raise ConfigError."""
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "str": str, "bool": bool}.get(annotation, Any)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, bool) and bool in args:
            return value
        return _coerce(value, args[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        return [_coerce(item, typing.get_args(annotation)[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
        if abs(value) >= MAX_INT:
            raise ConfigError(f"{where}: integer out of range (at most 2**63 - 1 in magnitude), got {shown(value)}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {shown(value)}")
        if isinstance(value, int) and abs(value) >= MAX_INT:
            raise ConfigError(f"{where}: number out of range, got {shown(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) \
                or isinstance(value, int) and abs(value) >= MAX_INT:
            raise ConfigError(f"{where}: expected a string, got {shown(value)}")
        return str(value)
    return value


OVERRIDE_SOURCE = "command line (--set)"
"""The source named by an error in a value given as an override rather than read from the params file."""

MAX_YAML_DEPTH = 32
"""Deepest nesting of collections a params file or ``--set`` value may have (params.yaml needs 3)."""
MAX_YAML_NODES = 100_000
"""Most values a params file or ``--set`` value may hold with every alias expanded (a "billion laughs"
file of nested aliases holds 10**9 in a few hundred bytes)."""


class _ParamsLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: nesting past :data:`MAX_YAML_DEPTH`, more than :data:`MAX_YAML_NODES`
    values with aliases expanded, and a key given twice in one mapping (DVC refuses that file too) are
    errors marked with their line."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        sizes: dict[int, int] = {}

        def size(n: Any) -> int:  # memoised per node: an alias is the node it names, counted each time used
            if id(n) not in sizes:
                sizes[id(n)] = MAX_YAML_NODES + 1  # until counted: an alias inside its own anchor never ends
                children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
                    n.value if isinstance(n, yaml.SequenceNode) else []
                sizes[id(n)] = 1 + sum(size(c) for c in children)
            return sizes[id(n)]

        if size(node) > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_NODES} values with its aliases "
                                              "expanded", node.start_mark)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *defaults" merges; a key given after it wins
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable):  # an unhashable key is PyYAML's own error, next
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {shown(key)} appears twice in one "
                                                            "mapping", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _load_yaml(text: str, source: str) -> Any:
    """``text`` as YAML (:class:`_ParamsLoader`), else a ConfigError naming ``source`` and the line."""
    try:
        return yaml.load(text, Loader=_ParamsLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}:" if mark is not None else ""
        raise ConfigError(f"{source}:{line} not valid YAML: {exc}") from None
    except (ValueError, OverflowError) as exc:  # a scalar PyYAML resolves but cannot build: 2020-13-45, 10**5000
        raise ConfigError(f"{source}: a value YAML cannot read: {exc}") from None


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """Parse ``["lr=3e-4", "packing=true"]`` into a dict, values read as YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"{OVERRIDE_SOURCE}: {shown(pair)}: expected field=value")
        key, raw = pair.split("=", 1)
        out[key.strip()] = _load_yaml(raw, f"{OVERRIDE_SOURCE}: {key.strip()}") if raw.strip() else ""
    return out

# Names other trainers (TRL, HF Trainer) use for a field alignflow spells differently: "did you mean" for them.
KNOWN_ALIASES = {"learning_rate": "lr", "per_device_train_batch_size": "batch_size",
                 "gradient_accumulation_steps": "grad_accum", "model_name_or_path": "model_path",
                 "num_generations": "group_size", "max_seq_length": "max_length"}


def unknown_field(section: str, key: str, known: set[str]) -> str:
    """``section.key: unknown field; did you mean section.<closest>?`` (difflib, or a known alias), else the
    known fields, clipped so the message stays a few lines."""
    alias = KNOWN_ALIASES.get(key)
    close = [alias] if alias in known else difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"{section}.{key}: unknown field; did you mean {section}.{close[0]}?"
    listed = ", ".join(sorted(known))
    if len(listed) > 240:
        listed = listed[:listed.rfind(", ", 0, 220)] + f", ... ({len(known)} in all)"
    return f"{section}.{key}: unknown field; known fields are {listed}"


def build_config(cls: type[T], section: str, values: dict[str, Any], source: str = "<overrides>",
                 overridden: typing.Collection[str] = ()) -> T:
    """Construct ``cls`` from a mapping, rejecting unknown keys and mistyped values.

    ``overridden``: the keys of ``values`` that came from overrides, not from ``source``: an error in one
    of them names :data:`OVERRIDE_SOURCE` instead, so a typo on the command line never blames the file."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section {section!r} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = OVERRIDE_SOURCE if key in overridden else source
        if key not in known:
            raise ConfigError(f"{where}: {unknown_field(section, str(key), known)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}: {section}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        named = re.match(r"\A(\w++)\.\w++", message)  # the checks name "section.field: ..." first
        if named and named[1] != section:  # the same fields under another section's name (tool_rl): name this one
            message = section + message[len(named[1]):]
        # A check that names an overridden field (its own, or the other one of a cross-field check) blames the
        # command line: the file's value was fine until the override changed its partner.
        blamed = OVERRIDE_SOURCE if set(re.findall(r"\w+", message)) & set(overridden) else source
        raise ConfigError(f"{blamed}: {message}") from None


def config_to_dict(config: Any) -> dict[str, Any]:
    """Flat dict of a config's fields (for MLflow params and cache keys)."""
    return dataclasses.asdict(config)


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field, read from the source (for ``--help``)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(inspect.getsource(klass))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs
