"""Helpers of the key tables: engine command lines, dtype names, ROLL device mappings."""

import pytest

from rlstream.common.config import ConfigError
from rlstream.common.importers.common import device_count, dtype_of, engine_arg
from rlstream.common.importers.rules import Context, Imported


def _ctx(key="k"):
    return Context({}, Imported(system="X"), key)


def test_engine_options_append_to_the_engine_command_line():
    ctx = _ctx()
    assert engine_arg("--mem-fraction-static")(0.55, ctx) is None
    assert engine_arg("--enable-torch-compile")(True, ctx) is None
    assert engine_arg("--disable-cuda-graph")(False, ctx) == "false: the engine's default (no --disable-cuda-graph)"
    assert engine_arg("--x")(None, ctx) == "null: the engine's default"
    assert ctx.t.config == {"launcher": {"engine": {"args": ["--mem-fraction-static", "0.55",
                                                             "--enable-torch-compile"]}}}


@pytest.mark.parametrize("name,dtype", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"),
                                        ("bfloat16", "bfloat16"), ("FP32", "float32")])
def test_dtype_names(name, dtype):
    ctx = _ctx()
    assert dtype_of(name, ctx) is None and ctx.t.config == {"actor": {"dtype": dtype}}


def test_an_unknown_dtype_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"^a.precision='fp8': rlstream trains in bf16, fp16 or fp32"):
        dtype_of("fp8", _ctx("a.precision"))


@pytest.mark.parametrize("value,n", [("list(range(0,16))", 16), ("list(range(8, 16))", 8), ([0, 1, 2], 3),
                                     ("0,1", 2), ("list(range(0,8,2))", 4), ("gpus", None)])
def test_device_mappings(value, n):
    assert device_count(value) == n
