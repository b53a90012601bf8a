"""Pipeline parallelism in the hf backend: a decoder's layers divided into consecutive stages over ranks.

`actor.fsdp.pipeline_parallel` = P (cosmos-rl `policy.parallelism.pp_size`, Megatron's
`pipeline_model_parallel_size`): P consecutive ranks of a data-parallel replica each hold one stage
— stage 0 the embeddings and the first layers, the last stage the final layers, the final norm and
the LM head — so each holds about 1/P of the weights, gradients and optimizer state, and of the
activations. With `virtual_pipeline_stages` = V (Megatron's virtual_pipeline_model_parallel_size) the
layers form P x V chunks and stage s holds chunks s, s + P, ... (Megatron's interleaved assignment).
The model is split in place, without model code: another stage's layers become slots that pass the
hidden states through, except where this stage's hidden states leave (after one of its chunks) or
arrive (before one); the last stage broadcasts the logits to its peers, so every rank of the replica
computes the same loss and statistics with the trainer's own code. In backward each stage receives the
gradient of what left from the next stage and sends that of what arrived to the previous one (custom
autograd functions: the transfers happen where autograd reaches them).

The stages run one micro-batch at a time in turn (forward through the stages, then backward back): a
stage waits while the others compute, as Megatron with one micro-batch in flight does; memory, not
speed, is what this splitting buys (so virtual stages add transfers and save nothing here: they exist
so a Megatron layout runs as configured). Tied input/output embeddings are held by the first and the
last stage, their gradients summed between the two (Megatron's embedding group). Checkpoints, HF exports
and weight pushes gather every stage's tensors on rank 0 under the model's own names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlstream.common.config import ConfigError
from rlstream.common.logging import get_logger

log = get_logger(__name__)

__all__ = ["Pipeline", "stage_layers"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool]
_HEADER = 8  # dtype, ndim, up to six sizes


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """Consecutive layers of each stage, the first stages taking one more when they do not divide evenly."""
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


# ---- point-to-point transfers of one tensor of any shape: a header, then the data ----------------------
def _header(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    sizes = list(t.shape) + [0] * (_HEADER - 2 - t.dim())
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *sizes], dtype=torch.int64, device=device)


def _from_header(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    code, ndim, *sizes = h.tolist()
    return torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=device)


def _send(t: torch.Tensor, dst: int, device: torch.device) -> None:
    dist.send(_header(t, device), dst)
    dist.send(t.detach().contiguous().to(device), dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    h = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(h, src)
    buf = _from_header(h, device)
    dist.recv(buf, src)
    return buf


def _broadcast(t: torch.Tensor | None, src: int, group: Any, device: torch.device) -> torch.Tensor:
    h = _header(t, device) if t is not None else torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.broadcast(h, src, group=group)
    buf = t.detach().contiguous() if t is not None else _from_header(h, device)
    dist.broadcast(buf, src, group=group)
    return buf


# ---- autograd across stages --------------------------------------------------------------------------
class _Handoff(torch.autograd.Function):
    """At a layer slot of another stage: sends this stage's hidden states on (`send`) and/or takes the previous
    stage's (`recv`); backward sends the gradient of what arrived back and takes that of what left. What leaves
    and arrives nowhere flows on as zeros of its shape: it keeps autograd's path to this stage's layers."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, pipe: "Pipeline", send: bool, recv: bool) -> torch.Tensor:
        ctx.pipe, ctx.send, ctx.recv, ctx.shape, ctx.dtype = pipe, send, recv, hidden.shape, hidden.dtype
        if send:
            _send(hidden, pipe.next_rank, pipe.device)
        return _recv(pipe.prev_rank, pipe.device) if recv else hidden.new_zeros(hidden.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pipe = ctx.pipe
        if ctx.recv:
            _send(grad, pipe.prev_rank, pipe.device)
        back = _recv(pipe.next_rank, pipe.device) if ctx.send else torch.zeros(ctx.shape, dtype=ctx.dtype,
                                                                                device=grad.device)
        return back, None, None, None


class _LogitsFromLast(torch.autograd.Function):
    """The last stage's logits; backward reaches this stage's own layers through `_Handoff` (a zero gradient)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, pipe: "Pipeline") -> torch.Tensor:
        ctx.shape, ctx.dtype = hidden.shape, hidden.dtype
        return _broadcast(None, pipe.last_rank, pipe.group, pipe.device)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return torch.zeros(ctx.shape, dtype=ctx.dtype, device=_grad.device), None


class _NoEmbeddings(torch.nn.Module):
    """In place of the embeddings on stages after the first: zeros of their shape (the first hidden states this
    stage computes on arrive at a layer slot)."""

    def __init__(self, embed: torch.nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = embed.num_embeddings, embed.embedding_dim, \
            embed.weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.embedding_dim, dtype=self.dtype, device=input_ids.device,
                           requires_grad=torch.is_grad_enabled())


class _PassThrough(torch.nn.Module):
    """A layer of another stage."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class _Slot(_PassThrough):
    """A layer of another stage where this stage's hidden states leave (after its chunk) or arrive (before one)."""

    def __init__(self, pipe: "Pipeline", send: bool, recv: bool) -> None:
        super().__init__()
        self.pipe, self.send, self.recv = pipe, send, recv

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return _Handoff.apply(hidden_states, self.pipe, self.send, self.recv)


class _RemoteHead(torch.nn.Module):
    """In place of the LM head on stages before the last: the logits the last stage broadcasts."""

    def __init__(self, pipe: "Pipeline", out_features: int) -> None:
        super().__init__()
        self.pipe, self.out_features = pipe, out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _LogitsFromLast.apply(hidden, self.pipe)


@dataclass
class Pipeline:
    """This rank's place in its replica's pipeline: stage `stage` of `stages`, the replica's ranks by stage."""

    stages: int
    stage: int
    ranks: list[int]
    device: torch.device
    group: Any = None  # the replica's pipeline ranks (logits broadcast)
    tie_group: Any = None  # first and last stage (tied embeddings' gradients)
    chunks: int = 1  # chunks of layers per stage (virtual stages, interleaved)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def prev_rank(self) -> int:  # (the last stage's, before a first stage's second chunk)
        return self.ranks[(self.stage - 1) % self.stages]

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.stage + 1) % self.stages]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def gathers(self) -> bool:
        """Whether this rank's replica is the one whose stages gather the weights on rank 0 (the first)."""
        return self.ranks[0] == 0

    # ---- the split ---------------------------------------------------------------------------
    def split(self, model: torch.nn.Module, key: str = "actor.fsdp.pipeline_parallel") -> None:
        """Keep this stage's part of an HF causal LM (or a value model's scalar `score` head), in place (before it
        moves to its device): its `chunks` chunks of consecutive layers (chunk j of the stages x chunks belongs to
        stage j mod stages: Megatron's interleaved assignment), the embeddings on the first stage, the final norm and
        the head on the last."""
        decoder, head_name = _parts(model, key)
        head = getattr(model, head_name)
        layers = decoder.layers
        n = len(layers)
        if n < self.stages * self.chunks:
            raise ConfigError(f"{key}={self.stages}: the model has {n} decoder layers, fewer than stages"
                              + (f" x {self.chunks} virtual stages" if self.chunks > 1 else ""))
        owner = [j % self.stages for j, chunk in enumerate(stage_layers(n, self.stages * self.chunks)) for _ in chunk]
        mine = [o == self.stage for o in owner]
        embed = decoder.embed_tokens
        model._rls_tied = head.weight is embed.weight  # the first and the last stage each hold a copy
        for i in range(n):
            if not mine[i]:
                send, recv = i > 0 and mine[i - 1], i + 1 < n and mine[i + 1]
                layers[i] = _Slot(self, send, recv) if send or recv else _PassThrough()
        if not self.first:
            decoder.embed_tokens = _NoEmbeddings(embed)
        if not self.last:
            decoder.norm = torch.nn.Identity()
            setattr(model, head_name, _RemoteHead(self, head.out_features))
        else:
            head.register_forward_hook(self._share_logits)
        own = [i for i in range(n) if mine[i]]
        model._rls_pipeline = self
        log.info("pipeline stage %d of %d: decoder layers %s%s%s, %.1fM parameters", self.stage, self.stages,
                 _spans(own), ", the embeddings" if self.first else "",
                 f", the final norm and {head_name}" if self.last else "",
                 sum(p.numel() for p in model.parameters()) / 1e6)

    def _share_logits(self, _module, _args, logits: torch.Tensor) -> None:
        _broadcast(logits, self.last_rank, self.group, self.device)

    # ---- gradients ------------------------------------------------------------------------------
    def tied_param(self, model: torch.nn.Module) -> torch.nn.Parameter | None:
        """This stage's copy of tied embeddings, when it holds one and another stage holds the other."""
        if not _tied(model) or self.stages == 1 or not (self.first or self.last):
            return None
        return model.get_input_embeddings().weight if self.first else model.lm_head.weight

    def sum_tied_grads(self, model: torch.nn.Module) -> None:
        """The first and the last stage's gradients of the tied embeddings, summed on both."""
        p = self.tied_param(model)
        if p is None or p.grad is None:
            return
        g = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
        dist.all_reduce(g, group=self.tie_group)

    def norm_squares(self, squares: float, model: torch.nn.Module) -> float:
        """The squared gradient norm over every stage from this stage's (`squares`), the tied copy counted once."""
        tied = self.tied_param(model) if self.last else None
        if tied is not None and tied.grad is not None:
            g = tied.grad
            n = torch.linalg.vector_norm(g.full_tensor() if hasattr(g, "full_tensor") else g, dtype=torch.float64)
            squares -= float(n) ** 2
        t = torch.tensor([squares], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return float(t)

    # ---- whole tensors on rank 0 ----------------------------------------------------------------
    def whole_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Rank 0: the model's whole state dict, every stage's tensors on the CPU; elsewhere {} (collective; under
        FSDP2 each stage's replicas gather its shards first)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # (no cpu_offload: it keeps the gathered tensors on global rank 0 only, not on each stage's first rank)
        local = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        # Non-tensor extra state (megatron-core's local linears report None) has nothing to gather.
        return self.gather({k: v for k, v in local.items() if isinstance(v, torch.Tensor)})[0]

    def gather(self, local: dict[str, torch.Tensor], extra: Any = None) -> tuple[dict[str, torch.Tensor], list]:
        """Rank 0: every stage's tensors (its own first) on the CPU and every stage's JSON-able `extra`; elsewhere
        ({}, []). A collective of the first replica's stages; the other replicas hold the same and return at once."""
        if not self.gathers:
            return {}, []
        if not self.first:
            meta = json.dumps({"names": list(local), "extra": extra}).encode()
            _send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), self.ranks[0], self.device)
            for t in local.values():
                _send(t, self.ranks[0], self.device)
            return {}, []
        out, extras = {k: v.cpu() for k, v in local.items()}, [extra]
        for src in self.ranks[1:]:
            meta = json.loads(_recv(src, self.device).cpu().numpy().tobytes())
            extras.append(meta["extra"])
            for name in meta["names"]:
                out[name] = _recv(src, self.device).cpu()
        return out, extras

    def gather_optimizer(self, osd: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: the stages' full optimizer state dicts (keyed by parameter names) merged into one."""
        tensors, rest = {}, {"state": {}, "param_groups": osd.get("param_groups", [])}
        for name, state in osd.get("state", {}).items():
            rest["state"][name] = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            tensors.update({f"{name}\x00{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
        tensors, stage_rests = self.gather(tensors, rest)
        if not stage_rests:
            return {}
        merged: dict[str, Any] = {"state": {}, "param_groups": [dict(g, params=[]) for g in rest["param_groups"]]}
        for stage_rest in stage_rests:
            merged["state"].update(stage_rest["state"])
            for group, theirs in zip(merged["param_groups"], stage_rest["param_groups"]):
                group["params"] += theirs["params"]
        for key, t in tensors.items():
            name, k = key.split("\x00")
            merged["state"].setdefault(name, {})[k] = t
        return merged

    def local_model_state(self, model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This stage's part of a whole model's state dict (a tied head takes the embeddings when it is missing)."""
        names = set(getattr(model, "module", model).state_dict())
        if _tied(model) and _HEAD not in full and _EMBED in full:
            full = dict(full, **{_HEAD: full[_EMBED]})
        return {k: v for k, v in full.items() if k in names}

    def local_optimizer_state(self, model: torch.nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
        """This stage's part of a whole optimizer state dict (keyed by parameter names)."""
        names = set(getattr(model, "module", model).state_dict())
        alias = {_HEAD: _EMBED} if _tied(model) and _HEAD in names and _HEAD not in osd["state"] else {}
        state = {k: v for k, v in osd["state"].items() if k in names}
        state.update({k: osd["state"][src] for k, src in alias.items() if src in osd["state"]})
        rename = {src: k for k, src in alias.items()}
        groups = [dict(g, params=[n for n in (rename.get(p, p) for p in g["params"]) if n in names])
                  for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}

    @staticmethod
    def drop_tied_head(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A gathered state dict as the whole model's HF export and push name it: a tied head is not a tensor."""
        return {k: v for k, v in sd.items() if k != _HEAD} if _tied(model) else sd


_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _tied(model: torch.nn.Module) -> bool:
    """Whether `split` found the model's input and output embeddings tied (through DDP's wrapper)."""
    return bool(getattr(getattr(model, "module", model), "_rls_tied", False))


def _spans(layers: list[int]) -> str:
    """`0-3, 8-11` for the layers [0, 1, 2, 3, 8, 9, 10, 11]."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" for a, b in runs)


def _parts(model: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str]:
    """The decoder (embed_tokens, layers, norm) and the head's name (lm_head, or a value model's score) of a
    Llama-kind model, or one line saying why not."""
    import transformers

    decoder = getattr(model, "model", None)
    head_name = "lm_head" if hasattr(model, "lm_head") else "score"
    if not all(hasattr(decoder, a) for a in ("embed_tokens", "layers", "norm")) or \
            type(getattr(model, head_name, None)) is not torch.nn.Linear:
        raise ConfigError(f"{key}: {type(model).__name__} is not a decoder of the Llama kind (model.embed_tokens, "
                          "model.layers, model.norm, lm_head or score); pipeline stages split those")
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 56):
        raise ConfigError(f"{key}: needs transformers >= 4.56 (decoder layers that return their hidden states)")
    cfg = model.config
    if any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                   "logits_scaling")):
        raise ConfigError(f"{key}: {type(model).__name__} post-processes its logits; pipeline stages broadcast the "
                          "LM head's output")
    return decoder, head_name
