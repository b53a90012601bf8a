"""The inference-engine process: the local engine behind SGLang's HTTP subset, and rlstream's vLLM server.

`server` (HTTP routes), `local` (the local engine, composing `scheduler`, `kv_batch`,
`prefix_cache`, `model_weights` and `sampling`), `weights` (the receiving side of weight
updates), `vllm_server` + `vllm_routes` + `vllm_worker_ext` (vLLM with the same
weight-update routes). Both ends of the HTTP contract import `rlstream.common.engine_api`.
"""
