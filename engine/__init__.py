"""The inference-engine process: the local engine behind SGLang's HTTP subset, and rlstream's vLLM server.

`server` (HTTP routes), `local` (the scheduler and KV batch), `sampling`, `weights` (the
receiving side of weight updates), `vllm_server` + `vllm_worker_ext` (vLLM with the same
weight-update routes). Both ends of the HTTP contract import `rlstream.common.engine_api`.
"""
