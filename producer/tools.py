"""Tools a model can call: the interface, the built-in `calculator` and `python`, loading by import path.

A tool is an object with `name`, `schema` (the OpenAI function schema the chat template
renders through `tools=`) and `async run(arguments) -> str`. It raises `ToolError` (or
anything) for a bad call; the environment turns that into an error observation and
the episode continues. `agent.tools` lists factories by import path
(`module:callable`), each called with `cfg=` (the whole Config). The interface is
`rlstream.api.tool` (re-exported here).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rlstream.api.tool import Tool, ToolError
from rlstream.common.config import Config
from rlstream.producer.rewards import import_by_path
from rlstream.producer.sandbox import Sandbox

__all__ = ["Tool", "ToolError", "Calculator", "PythonTool", "calculator", "python", "load_tools", "evaluate_arithmetic"]


def _function(name: str, description: str, param: str, param_doc: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {param: {"type": "string", "description": param_doc}},
                       "required": [param]}}}


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 1e100


def evaluate_arithmetic(expression: str) -> int | float:
    """+ - * / // % ** and parentheses on numbers, evaluated on the AST (no eval); bounded size."""
    if len(expression) > 200:
        raise ToolError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 1e6):
                raise ToolError("exponent or base too large")
            try:
                out = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            if isinstance(out, complex) or (isinstance(out, float) and not math.isfinite(out)) \
                    or abs(out) > _MAX_MAGNITUDE:
                raise ToolError("result out of range")
            return out
        raise ToolError(f"unsupported syntax in {expression!r}: only numbers, + - * / // % ** and parentheses")

    return ev(tree)


class Calculator:
    """Arithmetic on the AST, in-process (no code runs): the tool of the CPU demo."""

    name = "calculator"
    schema = _function("calculator", "Evaluate an arithmetic expression, e.g. 123*45.", "expression",
                       "numbers with + - * / // % ** and parentheses")

    async def run(self, arguments: dict[str, Any]) -> str:
        expr = arguments.get("expression", arguments.get("input"))
        if not isinstance(expr, str):
            raise ToolError("calculator needs a string argument 'expression'")
        out = evaluate_arithmetic(expr)
        if isinstance(out, float) and out.is_integer():
            out = int(out)
        return str(out)


class PythonTool:
    """Runs the code in the sandbox (producer/sandbox.py); stdout + stderr is the observation."""

    name = "python"
    schema = _function("python", "Run Python code in a fresh sandbox and return what it prints.", "code",
                       "a complete Python program; print the result")

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    async def run(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code", arguments.get("input"))
        if not isinstance(code, str):
            raise ToolError("python needs a string argument 'code'")
        res = await self.sandbox.run(code)
        if res.error is not None:
            raise ToolError(f"{res.error}\n{res.output}".rstrip())
        return res.output


def calculator(cfg: Config | None = None, **_: Any) -> Calculator:
    return Calculator()


def python(cfg: Config, **_: Any) -> PythonTool:
    return PythonTool(Sandbox(cfg.agent.sandbox))


def load_tools(cfg: Config) -> dict[str, Tool]:
    """`agent.tools` built by import path, by name; duplicate names are a config error."""
    tools: dict[str, Tool] = {}
    for i, path in enumerate(cfg.agent.tools):
        tool = import_by_path(path, f"agent.tools[{i}]")(cfg=cfg)
        for attr in ("name", "schema", "run"):
            if not hasattr(tool, attr):
                raise ValueError(f"agent.tools[{i}]={path!r} built {type(tool).__name__}, which has no {attr!r}")
        if tool.name in tools:
            raise ValueError(f"agent.tools[{i}]={path!r}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools
