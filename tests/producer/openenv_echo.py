"""An OpenEnv environment server written with openenv-core's own classes, for the tests: each step echoes the
action's message with a reward of its length / 100; the episode ends after `STEPS` steps. An episode reset with
seed 13 raises on its second step (the server answers an error). Served by
`python -m uvicorn tests.producer.openenv_echo:app --host 127.0.0.1 --port N`."""

from __future__ import annotations

from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app

STEPS = 3
RAISING_SEED = 13


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str = ""
    step: int = 0


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.seed: int | None = None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **_: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.seed = seed
        return EchoObservation(echoed=f"ready {seed}", step=0)

    def step(self, action: EchoAction, timeout_s: Optional[float] = None, **_: Any) -> EchoObservation:
        self._state.step_count += 1
        if self.seed == RAISING_SEED and self._state.step_count == 2:
            raise RuntimeError("the echo environment broke")
        return EchoObservation(echoed=action.message, step=self._state.step_count,
                               done=self._state.step_count >= STEPS, reward=len(action.message) / 100)

    @property
    def state(self) -> State:
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=8)
