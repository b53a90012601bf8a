"""The tool interface: what a model can call in an agent episode.

`agent.tools` lists tool factories by import path (`module:callable`), each called with
`cfg=` (the whole Config). The built-in ones are `producer.tools.calculator` and
`producer.tools.python`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Tool", "ToolError"]


class ToolError(Exception):
    """A tool call that cannot be served; the message goes back to the model."""


@runtime_checkable
class Tool(Protocol):
    """A callable tool.

    Attributes:
        name: the name the model calls it by.
        schema: the OpenAI function schema the chat template renders through `tools=`.
    """

    name: str
    schema: dict[str, Any]

    async def run(self, arguments: dict[str, Any]) -> str:
        """Run one call.

        Args:
            arguments: the call's arguments (a JSON object, as the model wrote them).

        Returns:
            The observation text. Raise `ToolError` (or anything) for a bad call: the
            environment turns it into an error observation and the episode continues.
        """
        ...
