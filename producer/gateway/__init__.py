"""`rlstream gateway`: an OpenAI-compatible endpoint that records an agent's calls as training episodes.

Any agent written against the `openai` SDK (or a framework on top of it) is trained
without changes: point its client at a session's base URL,

    sid = POST /sessions {"group": optional name, "group_size": optional n} -> {"session_id", "base_url"}
    client = OpenAI(base_url=f"{gateway}/sessions/{sid}/v1", api_key="unused")
    ... client.chat.completions.create(messages=..., tools=...)   # as many calls as the agent makes
    POST /sessions/{sid}/reward {"reward": 1.0}                     # ends the episode

(or send the id in an `X-Session-Id` header to `/v1/...`). Served: `POST /v1/chat/completions`
(`tools`, `n`, `temperature`, `top_p`, `frequency_penalty`, `presence_penalty`,
`max_tokens`/`max_completion_tokens`, `stop` (sent to the engine), `stream`, `logprobs`, vLLM's
`return_token_ids`, and structured outputs: `response_format`, an enforced `tool_choice`,
`parallel_tool_calls`, constrained in the engine, `structured.py`), `POST /v1/completions` and
`GET /v1/models`; `gateway.sampling` says whether a request's sampling parameters or gconfig's apply.

Token-in, token-out: each call's exact ids, logprobs and versions are kept, a call that extends a
conversation continues its branch, and each branch is one trajectory (`calls.py`). Sessions form
groups committed through one admission lease each (`sessions.py`). The HTTP routes are `app.py`,
the process `server.py`, the request bodies `structs.py`.

Errors are JSON `{"error": {"message", "code"}}`: 400 a body that does not fit (naming the
field; a structured output it cannot honour, with the grammar library's message) or a conversation
beyond the model's context, 404 an unknown session, 409 a finished
one, 410 one abandoned, 503 no admission capacity or the run finished.
"""

from rlstream.producer.gateway.app import build_app
from rlstream.producer.gateway.calls import Gateway
from rlstream.producer.gateway.server import ADDR_FILE_ENV, run_gateway, serve

__all__ = ["Gateway", "build_app", "run_gateway", "serve", "ADDR_FILE_ENV"]
