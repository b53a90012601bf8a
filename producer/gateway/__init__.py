"""`rlstream gateway`: an OpenAI-compatible endpoint that records an agent's calls as training episodes.

Any agent written against the `openai` SDK (or a framework on top of it) is trained
without changes: point its client at a session's base URL,

    sid = POST /sessions {"group": optional name, "group_size": optional n} -> {"session_id", "base_url"}
    client = OpenAI(base_url=f"{gateway}/sessions/{sid}/v1", api_key="unused")
    ... client.chat.completions.create(messages=..., tools=...)   # as many calls as the agent makes
    POST /sessions/{sid}/reward {"reward": 1.0}                     # ends the episode

(or send the id in an `X-Session-Id` header to `/v1/...`). Served: `POST /v1/chat/completions`
(`tools`, `n`, `temperature`, `top_p`, `max_tokens`/`max_completion_tokens`, `stop`,
`stream`, `logprobs`, vLLM's `return_token_ids`), `POST /v1/completions` and `GET /v1/models`.

Token-in, token-out, as in `producer/agent.py`: every call is answered by the engine pool
(`RolloutEngine`: per-token versions, continuation across weight updates) and its exact
ids, logprobs and versions are kept. A call whose messages extend a conversation the
session already has (the agent sent back the assistant messages it got, plus new tool or
user messages) continues that branch: the request's ids are the branch's ids, the end-of-
turn tokens and the chat template's token delta of the new messages (`ChatTemplate`) —
the earlier assistant turns are never re-tokenized from their text. Any other call starts
a new branch; each branch (a leaf of the session's call tree) is one trajectory.

Groups: sessions whose first call has the same prompt (or that named the same `group`)
form one group of `gateway.group_size` episodes. The group's first call takes one
admission lease (waiting up to `gateway.admission_timeout`; the agent sees the wait as
latency, then 503); when every member reported its reward the group is committed through
the lease (`group_from_episodes`, dynamic sampling as in the producer). A session idle past
`gateway.session_timeout` is abandoned and leaves its group; a group left empty abandons
its lease, one waiting that long for more members commits those that finished.

Errors are JSON `{"error": {"message", "code"}}`: 400 a body that does not fit (naming the
field) or a conversation beyond the model's context, 404 an unknown session, 409 a finished
one, 410 one abandoned, 503 no admission capacity or the run finished.
"""

from rlstream.producer.gateway.app import build_app
from rlstream.producer.gateway.calls import Gateway
from rlstream.producer.gateway.server import ADDR_FILE_ENV, run_gateway, serve

__all__ = ["Gateway", "build_app", "run_gateway", "serve", "ADDR_FILE_ENV"]
