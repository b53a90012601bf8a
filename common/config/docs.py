"""The config's reference, read from the schema itself: each field's type, default and docstring.

A field's docstring is the string literal on the line below it (`name: type = default` then `\"\"\"doc\"\"\"`, as in
torchtitan's job_config.py). Python keeps no such attribute docstrings at run time, so they are read from the
section's source with `ast`; `rlstream config docs` prints them and validation errors quote them.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import typing
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from rlstream.common.config.schema import Config

__all__ = ["FieldDoc", "field_reference", "field_docs", "field_docstring", "type_text", "allowed_values",
           "struct_fields"]


class FieldDoc(NamedTuple):
    """One config key as `rlstream config docs` prints it."""

    key: str  # dotted path, e.g. actor.optimizer.lr
    type: str  # what it accepts, e.g. `float > 0`, `one of 'adam', 'adamw', 'sgd'`, `OptimizerConfig`
    default: str  # JSON spelling (null, true, "text"): what YAML or a KEY=VALUE override takes; `(section)`
    doc: str  # the field's docstring on one line


@functools.cache
def _docstrings_in(path: str) -> dict[str, dict[str, str]]:
    """Class name -> {field: docstring on one line} for every class in the source file at `path`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out: dict[str, dict[str, str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        docs = out.setdefault(node.name, {})
        for field, after in zip(node.body, node.body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[field.target.id] = " ".join(after.value.value.split())
    return out


def field_docstring(section: type, name: str) -> str:
    """The docstring of field `name` of a section class (or of the base that declares it); "" if none."""
    for cls in section.__mro__:
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:  # a builtin base
            continue
        if path:
            doc = _docstrings_in(path).get(cls.__name__, {}).get(name)
            if doc:
                return doc
    return ""


def struct_fields(tp: Any) -> dict[str, Any] | None:
    """Field name -> type for a Struct type (unwrapping Optional/Annotated), else None."""
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp, include_extras=True)
        return {f: hints[f] for f in tp.__struct_fields__}
    return None


def _unwrap(tp: Any) -> Any:
    """Strip Annotated and `X | None` to get at a Struct type."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _unwrap(rest[0])
    return tp


def type_text(tp: Any) -> str:
    """What a field of type `tp` accepts, e.g. `int >= 1`, `one of 'adam', 'sgd'`, `float | None > 1`."""
    inner, metas = tp, []
    while True:
        if typing.get_origin(inner) is Annotated:
            args = typing.get_args(inner)
            inner = args[0]
            metas += [a for a in args[1:] if isinstance(a, Meta)]
            continue
        if typing.get_origin(inner) is list:  # a list's bounds are its items'
            return "list of " + type_text(typing.get_args(inner)[0]) if typing.get_args(inner) else "list"
        if typing.get_origin(inner) is dict and typing.get_args(inner):  # a mapping's bounds are its values'
            key, value = typing.get_args(inner)
            return f"mapping of {type_text(key)} to {type_text(value)}"
        options = typing.get_args(inner)
        if len(options) == 2 and type(None) in options and any(typing.get_origin(a) is list for a in options):
            return type_text(next(a for a in options if a is not type(None))) + ", or None"
        nested = [a for a in typing.get_args(inner) if typing.get_origin(a) is Annotated]
        if nested:  # X | None with bounds on X
            args = typing.get_args(nested[0])
            metas += [a for a in args[1:] if isinstance(a, Meta)]
            inner = args[0] | None
        break
    parts = []
    for arg in [inner, *typing.get_args(inner)]:
        if typing.get_origin(arg) is Literal:
            parts.append("one of " + ", ".join(repr(v) for v in typing.get_args(arg)))
    plain = [a.__name__ for a in typing.get_args(inner) if isinstance(a, type) and a is not type(None)]
    if parts and plain:  # e.g. bool | Literal["gaussian"]
        parts = [" or ".join(plain + parts)]
    if not parts:
        parts.append(re.sub(r"\b(typing|[\w.]+\.config(\.\w+)?)\.", "", str(inner)) if typing.get_args(inner)
                     else getattr(inner, "__name__", None) or str(inner))
    for m in metas:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
        if getattr(m, "min_length", None):
            parts.append(f"of length >= {m.min_length}")
    return " ".join(parts)


def allowed_values(tp: Any, dotted: str) -> str:
    """Describe what the field at `dotted` accepts and what it is, for error messages ("" if no such key)."""
    node: Any = Config
    section: Any = Config
    for part in dotted.split("."):
        fields = struct_fields(node)
        if fields is None or part not in fields:
            return ""
        section, node = _unwrap(node), fields[part]
    doc = field_docstring(section, dotted.rpartition(".")[2])
    return type_text(node) + (f" ({doc})" if doc else "")


def _defaults(section: Any) -> dict[str, Any]:
    """Field name -> default value of a Struct type (factories called)."""
    names = section.__struct_fields__
    out = dict(zip(names[len(names) - len(section.__struct_defaults__):], section.__struct_defaults__))
    for name, default in out.items():
        if isinstance(default, msgspec._core.Factory):  # type: ignore[attr-defined]
            out[name] = default.factory()
    return out


def field_reference(tp: Any = Config, prefix: str = "") -> list[FieldDoc]:
    """Every field under `tp`, depth first: a section's own line (default `(section)`), then its keys."""
    out: list[FieldDoc] = []
    section = _unwrap(tp)
    defaults = _defaults(section)
    for name, ftp in (struct_fields(tp) or {}).items():
        key, doc, default = f"{prefix}{name}", field_docstring(section, name), defaults.get(name)
        sub = struct_fields(ftp)
        if sub is not None and default is not None:
            out.append(FieldDoc(key, type_text(ftp), "(section)", doc))
        else:
            out.append(FieldDoc(key, type_text(ftp), msgspec.json.encode(default).decode(), doc))
        if sub is not None:  # an optional section, off by default, lists its keys too: they apply once it is set
            out.extend(field_reference(ftp, key + "."))
    return out


def field_docs(tp: Any = Config, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, description, default as JSON text or `(section)`) for every field, depth first."""
    return [(f.key, f.doc, f.default) for f in field_reference(tp, prefix)]
