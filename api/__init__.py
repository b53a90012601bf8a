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

from rlstream.api.engine_client import EngineClient, ModelRequest, ModelResponse
from rlstream.api.environment import Action, Environment, Reset, StepResult, ToolCall
from rlstream.api.reward import RewardFunction, RewardResult
from rlstream.api.tool import Tool, ToolError
from rlstream.api.weight_transport import TransferResult, WeightTransport
from rlstream.api.workflow import Generation, GenerationEngine, GroupFailed, Workflow

__all__ = [
    "Workflow", "GenerationEngine", "Generation", "GroupFailed",
    "Environment", "Action", "Reset", "StepResult", "ToolCall",
    "Tool", "ToolError",
    "RewardFunction", "RewardResult",
    "EngineClient", "ModelRequest", "ModelResponse",
    "WeightTransport", "TransferResult",
]
