"""Weight sync for vLLM: a worker extension (`--worker-extension-cls`).

vLLM mixes this class into each of its GPU/CPU workers; the methods run inside the
worker process and are driven from the API server by `collective_rpc(name, kwargs=...)`
(engine/vllm_server.py maps rlstream's SGLang-style HTTP routes onto them).

It runs inside the vLLM virtualenv (scripts/setup_vllm_venv.sh), which has torch and
vllm but none of rlstream's other dependencies, so it imports only torch, safetensors
(a vLLM dependency) and `rlstream.common.weights.dist` (torch only): the weight-sync group is
the same code on both ends. vllm_server.py makes the `rlstream` package importable in
the venv by path.

Protocol (the same as SGLang's, see ARCHITECTURE.md "Weight sync group"):
`init_weight_update_group` joins the trainer's group (trainer = rank 0, this engine's
workers = `rank_offset + worker rank`); `update_weights_from_distributed` receives each
tensor through a broadcast from rank 0 — the trainer broadcasts while the HTTP call that
triggered this is in flight — and hands them to vLLM's own `model.load_weights`, which
maps HF checkpoint names onto vLLM's fused layers (qkv_proj, gate_up_proj) and shards
for tensor parallelism.

Weights are loaded through vLLM's *layerwise reload* (the path its own weight-transfer
engines use), not straight into the parameters: after loading, vLLM repacks weights
into kernel formats (on CPU every linear weight is packed for oneDNN and the parameter
left empty), so a plain `load_weights` into a served model fails. A reload runs as a
session — `begin_weight_update`, any number of buckets, `end_weight_update` — and a layer
is re-processed as soon as all its checkpoint tensors arrived (a fused qkv_proj may span
two buckets); `end_weight_update` finishes the rest (padded vocab rows, layers the push did
not touch keep their current weights). The server keeps generation paused while a
session is open, since unloaded layers sit on the meta device meanwhile.

LoRA (`actor.lora`): a push carries only adapter tensors (`…lora_A.weight`,
`…lora_B.weight`) and their scaling. They are collected during the session and merged into
the base weights at its end (`engine/lora.py`: W0 + s·B·A, W0 read from the model folder),
then loaded like any update. A merged module that vLLM fuses with others (q/k/v into
qkv_proj, gate/up into gate_up_proj) is loaded together with its siblings' current
weights, because a fused layer is rebuilt only from a complete set of its checkpoint
tensors. An adapter folder (adapter_config.json) given to `update_weights_from_disk` is
merged the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlstream.common.weights.dist import WeightSyncGroup, init_weight_sync_group, parse_dtype
from rlstream.engine.lora import ADAPTER_CONFIG, AdapterMerger, is_adapter_tensor

__all__ = ["WeightSyncWorkerExtension"]

QUALNAME = "rlstream.engine.vllm_worker_ext.WeightSyncWorkerExtension"


class WeightSyncWorkerExtension:
    """Mixed into vLLM's Worker, which provides `self.model_runner`, `self.vllm_config`, `self.rank`.

    vLLM refuses an extension whose attribute names clash with the Worker's, hence the
    `rlstream_`/`_rls_` prefixes on state and helpers.
    """

    # ------------------------------------------------------------- group
    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str = "weight_sync", backend: str = "gloo",
                                 timeout_s: float = 300.0) -> dict[str, Any]:
        """Join the trainer's weight-sync group; returns once every rank joined."""
        groups = self._rls_groups()
        old = groups.pop(group_name, None)
        if old is not None:
            old.close()
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        group = init_weight_sync_group(master_address, int(master_port), rank, int(world_size), group_name,
                                       backend=backend, timeout_s=timeout_s)
        groups[group_name] = group
        return {"rank": rank, "world_size": group.world_size, "backend": group.backend}

    def destroy_weight_update_group(self, group_name: str | None = None) -> bool:
        groups = self._rls_groups()
        for name in [group_name] if group_name else list(groups):
            g = groups.pop(name, None)
            if g is not None:
                g.close()
        return True

    # ------------------------------------------------------------- update session
    def begin_weight_update(self) -> bool:
        """Open a layerwise-reload session (no-op when one is open). Generation must not run until it ends."""
        if getattr(self, "_rls_session_open", False):
            return False
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.model)
        self._rls_session_open = True
        return True

    def end_weight_update(self) -> bool:
        """Finish the session: process what is left, restore layers the push did not touch."""
        if not getattr(self, "_rls_session_open", False):
            return False
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        adapter = self._rls_adapter_weights()
        if adapter:
            self._rls_load(adapter)
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)
            self._rls_retie_lm_head()
        self._rls_session_open = False
        return True

    def weight_update_open(self) -> bool:
        return bool(getattr(self, "_rls_session_open", False))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str | None = None, lora_scaling: float | None = None) -> int:
        """Receive one bucket (each tensor broadcast from rank 0, in `names` order) into the session.

        The request is checked before the session opens, so a bad one leaves the model as it was.
        """
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes differ in length: {len(names)}/{len(dtypes)}/{len(shapes)}")
        group = self._rls_group(group_name)
        specs = [(name, parse_dtype(dtype), tuple(int(s) for s in shape))
                 for name, dtype, shape in zip(names, dtypes, shapes)]
        if lora_scaling is None and any(is_adapter_tensor(n) for n, _d, _s in specs):
            raise ValueError(f"LoRA adapter tensors ({specs[0][0]}, ...) came without lora_scaling")
        self.begin_weight_update()
        weights, adapter = [], []
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype, device=group.device)
            group.broadcast(tensor, src=0)
            (adapter if is_adapter_tensor(name) else weights).append((name, tensor))
        if adapter:  # merged at the end of the session, once every A has its B
            self._rls_pending_adapter().append((adapter, float(lora_scaling)))
        if weights:
            self._rls_load(weights)
        return len(weights) + len(adapter)

    def update_weights_from_disk(self, model_path: str) -> int:
        """Load every `*.safetensors` under `model_path` (a folder or one file) as one complete session."""
        from safetensors import safe_open

        path = Path(model_path)
        if path.is_dir() and (path / ADAPTER_CONFIG).is_file():  # a LoRA adapter folder: merge, then load
            self.begin_weight_update()
            try:
                merged = self._rls_merger().load_folder(path)
                self._rls_load(self._rls_with_fused_siblings(merged))
            finally:
                self.end_weight_update()
            return len(merged)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"update_weights_from_disk: no safetensors file at {model_path!r}")
        self.begin_weight_update()
        n = 0
        try:
            for f in files:
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    weights = [(k, sf.get_tensor(k)) for k in sf.keys()]
                self._rls_load(weights)
                n += len(weights)
        finally:
            self.end_weight_update()
        return n

    # ------------------------------------------------------------- helpers
    def _rls_groups(self) -> dict[str, WeightSyncGroup]:
        if not hasattr(self, "_rls_group_map"):
            self._rls_group_map: dict[str, WeightSyncGroup] = {}
        return self._rls_group_map

    def _rls_group(self, group_name: str | None) -> WeightSyncGroup:
        groups = self._rls_groups()
        if group_name is None and len(groups) == 1:
            return next(iter(groups.values()))
        if group_name not in groups:
            raise RuntimeError(f"no weight-sync group {group_name!r}: call /init_weights_update_group first "
                               f"(known: {sorted(groups)})")
        return groups[group_name]

    def _rls_merger(self) -> AdapterMerger:
        if getattr(self, "_rls_adapter_merger", None) is None:
            self._rls_adapter_merger = AdapterMerger(self.vllm_config.model_config.model)
        return self._rls_adapter_merger

    def _rls_pending_adapter(self) -> list:
        if not hasattr(self, "_rls_adapter_buckets"):
            self._rls_adapter_buckets: list = []
        return self._rls_adapter_buckets

    def _rls_adapter_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The merged weights of the adapter tensors this session received (with fused siblings)."""
        buckets, self._rls_adapter_buckets = self._rls_pending_adapter(), []
        merger = self._rls_merger() if buckets else None
        merged = [w for named, scaling in buckets for w in merger.add(named, scaling)]
        if merger is not None and merger.pending:
            raise ValueError(f"LoRA push ended without the other half of {sorted(merger.pending)[:3]}")
        return self._rls_with_fused_siblings(merged)

    def _rls_with_fused_siblings(self, merged: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`merged` plus the current weights of every module vLLM fuses with a merged one."""
        packed = getattr(self.model_runner.model, "packed_modules_mapping", {}) or {}
        have = {name for name, _ in merged}
        out = list(merged)
        for name, _ in merged:
            prefix, _, leaf_w = name.rpartition(".")  # ...q_proj, weight
            parent, _, leaf = prefix.rpartition(".")
            for group in packed.values():
                if leaf in group:
                    for sib in group:
                        sname = f"{parent}.{sib}.{leaf_w}"
                        if sname not in have:
                            have.add(sname)
                            out.append((sname, self._rls_merger().current(sname)))
        return out

    def _rls_retie_lm_head(self) -> None:
        """Tied embeddings (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B): make `lm_head` serve the pushed weights.

        A push carries `embed_tokens.weight` only (the checkpoint has no `lm_head.weight`, and
        vLLM's `load_weights` skips it for tied models), so the reload processes the embedding
        layer and never `lm_head`. On CPU, `lm_head` computes its logits with a packed copy of
        the weight that vLLM made when the model was loaded (`dispatch_cpu_unquantized_gemm`:
        oneDNN / SGL packing), which would keep the OLD output embedding: the engine would
        serve new layers with an old head. So: keep the tie (the shared parameter, updated in
        place by the reload) and rebuild lm_head's kernel from it.
        """
        model = self.model_runner.model
        text_config = getattr(self.vllm_config.model_config, "hf_text_config", None)
        if not getattr(text_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not isinstance(getattr(lm_head, "weight", None), torch.Tensor) or \
                not isinstance(getattr(embed, "weight", None), torch.Tensor):
            return  # pipeline stage without one of them, or another layout: nothing we know to re-tie
        if lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)

    def _rls_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        if not getattr(self, "_rls_session_open", False):
            raise RuntimeError("weights arrived outside an update session (begin_weight_update first)")
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.model.load_weights(weights=weights)
