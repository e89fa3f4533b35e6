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
import logging
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
log = logging.getLogger(__name__)


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
                 "num_generations": "rollout.group_size", "max_seq_length": "max_length"}


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


def section_fields(cls: type) -> dict[str, type]:
    """A config class's sections within it (``RLConfig``: ``kl`` -> ``KLSection`` ...): field name -> dataclass."""
    if not dataclasses.is_dataclass(cls):
        return {}
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints.get(f.name), type) and dataclasses.is_dataclass(hints[f.name])}


_NOTICED: set[tuple[str, str]] = set()


def _renamed_notice(where: str, section: str, old: str, new: str) -> None:
    """One line, once per source and key a process reads: an old flat key, read as its new dotted one."""
    if (where, f"{section}.{old}") not in _NOTICED:
        _NOTICED.add((where, f"{section}.{old}"))
        log.warning("%s: %s.%s is now %s.%s (read as that; rename it)", where, section, old, section, new)


def _regroup(cls: type, section: str, values: dict[str, Any], source: str,
             overridden: typing.Collection[str]) -> tuple[dict[str, Any], set[str]]:
    """``values`` with each section's keys gathered under its name: an old flat key (``cls.renamed``) and a dotted one
    (``kl.coef``, from ``--set``) join their section's mapping. Returns them and the overridden keys' new names."""
    renamed: dict[str, str] = getattr(cls, "renamed", {})
    sections = section_fields(cls)
    out: dict[str, Any] = {}
    given: dict[str, tuple[str, bool]] = {}  # new name -> the key it was given as, and whether overridden
    moved: set[str] = set()
    for key, value in values.items():
        where = OVERRIDE_SOURCE if key in overridden else source
        name = key
        if isinstance(key, str) and key in renamed and not (key in sections and isinstance(value, dict)):
            name = renamed[key]
            _renamed_notice(where, section, key, name)
        head, dot, rest = name.partition(".") if isinstance(name, str) else (name, "", "")
        if head not in sections:
            out[name] = value
            continue
        if not dot:
            if dataclasses.is_dataclass(value) and isinstance(value, sections[head]):  # a built section: its values
                value = dataclasses.asdict(value)
            if not isinstance(value, dict):
                fields = ", ".join(f.name for f in dataclasses.fields(sections[head]))
                raise ConfigError(f"{where}: {section}.{head}: a section of fields ({fields}), got {shown(value)}")
            items = {f"{head}.{k}": v for k, v in value.items()}
        else:
            items = {name: value}
        for full, v in items.items():
            label = full if key == head else key  # as the source spelled it: kl_coef, kl.coef, or kl: {coef: }
            if full in given and (key in overridden) == given[full][1]:
                raise ConfigError(f"{where}: {section}.{full} is given twice, as {section}.{given[full][0]} and "
                                  f"{section}.{label}; keep {section}.{full}")
            if full in given and key not in overridden:
                continue  # the file's value, already overridden on the command line
            given[full] = (label, key in overridden)
            sub, field_name = full.split(".", 1)
            out.setdefault(sub, {})[field_name] = v
            if key in overridden:
                moved.add(full)
    over = {k for k in overridden if k in out and k not in sections} | moved
    return out, over


def build_config(cls: type[T], section: str, values: dict[str, Any], source: str = "<overrides>",
                 overridden: typing.Collection[str] = ()) -> T:
    """Construct ``cls`` from a mapping, rejecting unknown keys and mistyped values.

    A section within ``cls`` (``RLConfig.kl``) is read from a nested mapping (``kl: {coef: 0.1}``), a dotted key
    (``kl.coef``) or the old flat key ``cls.renamed`` names (``kl_coef``, with a notice naming the new key).
    ``overridden``: the keys of ``values`` that came from overrides, not from ``source``: an error in one
    of them names :data:`OVERRIDE_SOURCE` instead, so a typo on the command line never blames the file."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section {section!r} must be a mapping, got {type(values).__name__}")
    sections = section_fields(cls)
    if sections:
        values, overridden = _regroup(cls, section, values, source, overridden)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = OVERRIDE_SOURCE if key in overridden else source
        if key in sections:
            kwargs[key] = _build_section(cls, sections[key], f"{section}.{key}", value, source,
                                         {k.split(".", 1)[1] for k in overridden if k.startswith(f"{key}.")})
            continue
        if key not in known:
            dotted = {f"{k}.{f.name}" for k, c in sections.items() for f in dataclasses.fields(c)}
            raise ConfigError(f"{where}: {unknown_field(section, str(key), known | dotted)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}: {section}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(_blamed(str(exc), section, source, overridden)) from None


def _build_section(owner: type, cls: type, where: str, values: Any, source: str, overridden: set[str]) -> Any:
    """One section within a config (``rl.kl``): its fields read as :func:`build_config` reads a section's."""
    try:
        return build_config(cls, where, values, source, overridden)
    except ConfigError as exc:
        head = where.rsplit(".", 1)[1]
        old = [k for k, v in getattr(owner, "renamed", {}).items() if k == head]
        if old and "unknown field" in str(exc):  # e.g. rl.environment: a section, its spec a string
            raise ConfigError(f"{exc} ({where} is a section now; the value the old key {head} took goes in "
                              f"{where}.{owner.renamed[head].split('.', 1)[1]})") from None
        raise


def _blamed(message: str, section: str, source: str, overridden: typing.Collection[str]) -> str:
    """A check's message (``section.field: ...``) with this section's name and its source: the file, or
    :data:`OVERRIDE_SOURCE` where it names an overridden field (its own, or the other one of a cross-field check: the
    file's value was fine until the override changed its partner)."""
    named = re.match(r"\A(\w++)\.\w++", message)  # the checks name "section.field: ..." first
    if named and named[1] != section:  # the same fields under another section's name (tool_rl): name this one
        message = section + message[len(named[1]):]
    words = {w.strip(".") for w in re.findall(r"[\w.]+", message)}
    hit = any(w == k or w.endswith(f".{k}") for w in words for k in overridden)
    return f"{OVERRIDE_SOURCE if hit else source}: {message}"


def config_to_dict(config: Any) -> dict[str, Any]:
    """Dict of a config's fields, a section within it as a nested dict (for cache keys and recorded configs)."""
    return dataclasses.asdict(config)


def config_params(config: Any) -> dict[str, Any]:
    """A config's fields as one flat mapping, a section's fields under dotted names (``kl.coef``): MLflow params."""
    out: dict[str, Any] = {}
    for key, value in config_to_dict(config).items():
        if key in section_fields(type(config)):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field, read from the source (for ``--help``); a section's fields within it
    (``RLConfig.kl``) follow it, named ``kl.coef``."""
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
    for name, section in section_fields(cls).items():  # a section's fields under dotted names: kl.coef
        docs.update({f"{name}.{k}": v for k, v in field_docs(section).items()})
    return docs
