"""The engine client interface: one inference server behind `agenerate`, `pause` and `resume`.

A client for a new server kind subclasses `EngineClient` and implements the three abstract
methods; `EngineClient.call(route, body)` sends one struct of the engine HTTP contract
(`common/engine_api.py`) and decodes the answer. The classes are defined in
`common/engine_client.py`, next to the built-in clients (`SGLangClient`, `VLLMClient`) that
subclass them, and named here with the other extension interfaces:

- `EngineClient(session, address, api_key=None, request_timeout=3600.0, *, compact=True)`:
  `session` an aiohttp ClientSession, `address` the server's `host:port` (or URL),
  `api_key` the bearer token (`rollout.api_key`), `request_timeout` the default seconds
  per request, `compact` asks rlstream's engines for msgpack answers.
  - `agenerate(req: ModelRequest) -> ModelResponse`: generate for one prompt.
  - `pause()`: abort running requests (they return partial output with finish_reason abort).
  - `resume()`: let generation continue after `pause`.
  - `health(timeout=5.0) -> bool` and `model_info(timeout=30.0) -> ModelInfo` are provided.
- `ModelRequest`: `input_ids`, `max_new_tokens`, `temperature`, `top_p`, `top_k`
  (>= `TOP_K_OFF` means off), `min_new_tokens`, `stop_token_ids`, `greedy`, `rid`, `stop` (strings),
  `frequency_penalty`, `presence_penalty`, `repetition_penalty`;
  `ModelRequest.from_gconfig(input_ids, gconfig)` fills it from `gconfig`.
- `ModelResponse`: `output_ids`, `output_logprobs` (of the sampling distribution),
  `finish_reason` ("stop", "length", "abort"), `output_versions` (per token, when the server
  reports them), `weight_version`, `server`, `latency`.
"""

from __future__ import annotations

from rlstream.common.engine_client import TOP_K_OFF, EngineClient, ModelRequest, ModelResponse

__all__ = ["EngineClient", "ModelRequest", "ModelResponse", "TOP_K_OFF"]
