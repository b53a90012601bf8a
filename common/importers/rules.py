"""The part every importer shares: the rule kinds of its key table, how a leaf key finds its rule, and
applying the rules to a parsed config.

A table maps dotted keys of the other system to one rule each; a `*` segment matches any one key
(ROLL's workers), and a key also covers everything under it (whole sections), the longest match winning.
The same tables classify the seed references in `rlstream config coverage`, so the coverage table
and the importers cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

from rlstream.common.areal import Translation
from rlstream.common.config import ConfigError, field_docs

__all__ = ["Same", "Convert", "Drop", "Missing", "Rule", "Table", "Imported", "UNKNOWN", "MISSING", "leaves",
           "lookup", "apply_table", "get"]

_DEFAULTS = {key: default for key, _, default in field_docs()}
_NOT_NULL = {key: default != "null" for key, default in _DEFAULTS.items()}  # keys that do not take null
UNKNOWN = "no rlstream key of that name or meaning"  # AReaL's importer says the same for a key it does not know
MISSING = "not in rlstream yet: "


@dataclass(frozen=True)
class Same:
    """The value is copied unchanged to one rlstream key of the same meaning."""
    dst: str


@dataclass(frozen=True)
class Convert:
    """The value becomes other rlstream keys. `fn(value, ctx)` sets them and returns None, or returns the
    reason the key is dropped for this value; it raises ConfigError for a value rlstream cannot honour."""
    keys: tuple[str, ...]
    fn: Callable[[Any, "Context"], str | None]
    note: str = ""

    @property
    def dst(self) -> str:
        return ", ".join(self.keys) + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Drop:
    """The key has no meaning in rlstream's design; the reason says what rlstream does instead."""
    reason: str


@dataclass(frozen=True)
class Missing:
    """A capability rlstream does not have (yet). A value in `off` (the system's "not used") is dropped
    with the reason; any other value stops the import, since the run would silently differ."""
    reason: str
    off: tuple[Any, ...] | None = None


Rule = Union[Same, Convert, Drop, Missing]
Table = dict[str, Rule]


@dataclass
class Imported(Translation):
    """A Translation that also says where each `same` key went (the names differ between systems)."""
    system: str = ""
    same_dst: dict[str, str] = field(default_factory=dict)

    def put(self, src: str, dst: str, value: Any) -> None:
        """Set dst from src; a second source that disagrees with the first is noted and loses."""
        node = self.config
        *parents, last = dst.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if last in node and node[last] != value:
            self.notes.append(f"{src}={value!r} disagrees with the {dst}={node[last]!r} already set; kept the first")
            return
        node[last] = value

    def summary(self) -> str:
        total = len(self.translated) + len(self.same) + len(self.dropped)
        lines = [f"translated {len(self.translated)}, same {len(self.same)}, dropped {len(self.dropped)} "
                 f"(of {total} {self.system} keys)"]
        lines += [f"  same        {src} -> {self.same_dst[src]}" for src in self.same]
        lines += [f"  translated  {src} -> {dst}" for src, dst in self.translated]
        lines += [f"  dropped     {src}: {why}" for src, why in self.dropped]
        lines += [f"  note        {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class Context:
    """What a Convert function sees: the whole input (for keys that depend on others) and the result."""
    data: dict[str, Any]
    t: Imported
    key: str


def leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        return [kv for k, v in data.items() for kv in leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, data)]


def get(data: dict[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def lookup(table: Table, key: str) -> Rule | None:
    """The rule of the longest table key that is key or a section above it; exact segments beat `*`."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        head = parts[:n]
        if (rule := table.get(".".join(head))) is not None:
            return rule
        for i in range(n):
            if (rule := table.get(".".join([*head[:i], "*", *head[i + 1:]]))) is not None:
                return rule
    return None


def apply_table(data: dict[str, Any], table: Table, system: str) -> Imported:
    """Every leaf key of `data` through its rule: same, translated or dropped with the reason."""
    if not isinstance(data, dict):
        raise ConfigError(f"a {system} config is a mapping of keys")
    t = Imported(system=system)
    for key, value in leaves(data):
        rule = lookup(table, key)
        if isinstance(rule, Same) and value is None and _NOT_NULL.get(rule.dst, False):
            t.dropped.append((key, f"null: rlstream's default {rule.dst}={_DEFAULTS[rule.dst]}"))
        elif isinstance(rule, Same):
            t.put(key, rule.dst, value)
            t.same.append(key)
            t.same_dst[key] = rule.dst
        elif isinstance(rule, Convert):
            why = rule.fn(value, Context(data, t, key))
            if why is None:
                t.translated.append((key, rule.dst))
            else:
                t.dropped.append((key, why))
        elif isinstance(rule, Drop):
            t.dropped.append((key, rule.reason))
        elif isinstance(rule, Missing):
            if rule.off is not None and value not in rule.off:
                allowed = " or ".join(repr(v) for v in rule.off)
                raise ConfigError(f"{system} key {key}={value!r}: {MISSING}{rule.reason}; remove the key or set it "
                                  f"to {allowed} to import the rest")
            t.dropped.append((key, MISSING + rule.reason))
        else:
            t.dropped.append((key, UNKNOWN))
    return t
