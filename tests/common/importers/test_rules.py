"""The shared rule kinds: which rule a key finds, and what each does to a parsed config."""

import pytest

from rlstream.common.config import ConfigError
from rlstream.common.importers.rules import MISSING, UNKNOWN, Convert, Drop, Missing, Same, apply_table, lookup

TABLE = {
    "a.b": Same("actor.optimizer.lr"),
    "a": Drop("section a is not used"),
    "*.lr": Same("actor.optimizer.lr"),
    "w.*.x": Drop("any worker's x"),
    "w.train.x": Same("seed"),
    "conv": Convert(("gconfig.temperature",), lambda v, c: c.t.put(c.key, "gconfig.temperature", v / 2)),
    "why": Convert(("gconfig.top_p",), lambda v, c: "this value means nothing here"),
    "gap": Missing("a capability", off=(False,)),
    "gap2": Missing("another capability"),
    "clip": Same("actor.c_clip"),
    "mb": Same("actor.mb_spec.max_tokens_per_mb"),
}


def test_the_longest_match_wins_and_exact_segments_beat_wildcards():
    assert lookup(TABLE, "a.b") == Same("actor.optimizer.lr")
    assert lookup(TABLE, "a.c.d") == Drop("section a is not used")
    assert lookup(TABLE, "opt.lr") == Same("actor.optimizer.lr")
    assert lookup(TABLE, "w.infer.x") == Drop("any worker's x")
    assert lookup(TABLE, "w.train.x") == Same("seed")
    assert lookup(TABLE, "nothing.here") is None


def test_each_leaf_ends_same_translated_or_dropped_once():
    data = {"a": {"b": 1e-3, "c": 5}, "conv": 1.0, "why": 3, "gap": False, "gap2": "on", "other": {"k": 1},
            "w": {"train": {"x": 7}}}
    t = apply_table(data, TABLE, "X")
    assert t.config == {"actor": {"optimizer": {"lr": 1e-3}}, "gconfig": {"temperature": 0.5}, "seed": 7}
    assert t.same == ["a.b", "w.train.x"] and t.same_dst["a.b"] == "actor.optimizer.lr"
    assert t.translated == [("conv", "gconfig.temperature")]
    assert dict(t.dropped) == {"a.c": "section a is not used", "why": "this value means nothing here",
                               "gap": MISSING + "a capability", "gap2": MISSING + "another capability",
                               "other.k": UNKNOWN}
    assert len(t.same) + len(t.translated) + len(t.dropped) == 8
    assert "same        a.b -> actor.optimizer.lr" in t.summary()


def test_a_missing_capability_switched_on_stops_the_import_with_one_line():
    with pytest.raises(ConfigError) as err:
        apply_table({"gap": True}, TABLE, "X")
    assert str(err.value) == ("X key gap=True: not in rlstream yet: a capability; remove the key or set it to "
                              "False to import the rest")


def test_null_is_copied_only_where_rlstream_takes_null():
    t = apply_table({"clip": None, "mb": None}, TABLE, "X")
    assert t.config == {"actor": {"c_clip": None}}
    assert t.dropped == [("mb", "null: rlstream's default actor.mb_spec.max_tokens_per_mb=16384")]


def test_two_sources_that_disagree_keep_the_first_and_say_so():
    t = apply_table({"a": {"b": 1e-3}, "opt": {"lr": 2e-3}}, TABLE, "X")
    assert t.config["actor"]["optimizer"]["lr"] == 1e-3
    assert t.notes == ["opt.lr=0.002 disagrees with the actor.optimizer.lr=0.001 already set; kept the first"]


def test_a_file_that_is_not_a_mapping_is_refused():
    with pytest.raises(ConfigError, match="a X config is a mapping of keys"):
        apply_table([1, 2], TABLE, "X")
