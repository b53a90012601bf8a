"""The extension interfaces a user implements, in one place (like AReaL's `areal/api/`).

- `workflow.py`: `Workflow` (`producer.workflow`), the `GenerationEngine` it generates with, `Generation`;
- `environment.py`: `Environment` (`agent.environment`), `Action`, `Reset`, `StepResult`, `ToolCall`;
- `tool.py`: `Tool` (`agent.tools`), `ToolError`;
- `reward.py`: `RewardFunction` (`producer.reward_fn`), `RewardResult`;
- `engine_client.py`: `EngineClient` (a new inference server kind), `ModelRequest`, `ModelResponse`;
- `weight_transport.py`: `WeightTransport` (`actor.weight_update_mode`), `TransferResult`.

Only `rlstream.common` is imported here; every other package may import this one. The
built-in implementations live where they are used (producer/, trainer/weights/), which
also re-export these names.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlstream.api.engine_client import EngineClient, ModelRequest, ModelResponse
    from rlstream.api.environment import Action, Environment, Reset, StepResult, ToolCall
    from rlstream.api.reward import RewardFunction, RewardResult
    from rlstream.api.tool import Tool, ToolError
    from rlstream.api.weight_transport import TransferResult, WeightTransport
    from rlstream.api.workflow import Generation, GenerationEngine, GroupFailed, Workflow

# Each name is imported from its module when first asked for: a process that needs one interface (a reward
# worker: `rlstream.api.reward`) does not pay for the others' imports (aiohttp, numpy).
_MODULE_OF = {
    "EngineClient": "engine_client", "ModelRequest": "engine_client", "ModelResponse": "engine_client",
    "Action": "environment", "Environment": "environment", "Reset": "environment", "StepResult": "environment",
    "ToolCall": "environment", "RewardFunction": "reward", "RewardResult": "reward", "Tool": "tool",
    "ToolError": "tool", "TransferResult": "weight_transport", "WeightTransport": "weight_transport",
    "Generation": "workflow", "GenerationEngine": "workflow", "GroupFailed": "workflow", "Workflow": "workflow",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__all__ = [
    "Workflow", "GenerationEngine", "Generation", "GroupFailed",
    "Environment", "Action", "Reset", "StepResult", "ToolCall",
    "Tool", "ToolError",
    "RewardFunction", "RewardResult",
    "EngineClient", "ModelRequest", "ModelResponse",
    "WeightTransport", "TransferResult",
]
