"""Applying pushed LoRA adapters on an engine: merged into the base weights, W = W0 + s·B·A.

With `actor.lora` the trainer pushes only what trains: the adapter tensors, named as peft saves them
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, `...lora_B.weight`),
and the update request carries the scaling `s` (`lora_alpha / r`, or `/ sqrt(r)` for
rsLoRA; when rank/alpha patterns give modules their own scalings the push carries s = 1 and
each B comes multiplied by its module's scaling). The full weights of peft's `modules_to_save`
come with them as plain weights of the base model. The engine keeps serving a plain model:
for every adapted module it computes
`W0 + s·B·A` in fp32 from the BASE weight `W0` — read once from the served model folder,
so merges never accumulate rounding from earlier versions — and loads the result like a
full-weight update. The local engine and the vLLM worker extension both use this class;
it needs only torch and safetensors (both are in the vLLM virtualenv).

A module's A and B may arrive in different buckets of one push: the first half waits in
`pending` until its partner comes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch

__all__ = ["AdapterMerger", "is_adapter_tensor", "adapter_scaling", "module_scalings", "ADAPTER_CONFIG"]

ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")


def is_adapter_tensor(name: str) -> bool:
    """A LoRA A/B matrix in peft's naming."""
    return _ADAPTER.match(name) is not None


def adapter_scaling(folder: str | Path) -> float:
    """`s` of a peft adapter folder (adapter_config.json: lora_alpha / r, or / sqrt(r) with rsLoRA), for
    modules no rank/alpha pattern names."""
    return module_scalings(folder)("")


def module_scalings(folder: str | Path) -> Callable[[str], float]:
    """Each module's `s` in a peft adapter folder: the `rlstream_scaling` a trainer's push folder states (its B
    matrices are pre-scaled per module), else lora_alpha / r with the module's own r and alpha from rank_pattern /
    alpha_pattern (peft's rule: the first key k with `(.*\\.)?(k)$` matching the module path), / sqrt(r) with rsLoRA."""
    cfg = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    if cfg.get("rlstream_scaling") is not None:
        fixed = float(cfg["rlstream_scaling"])
        return lambda _module: fixed

    def pick(patterns: dict[str, float] | None, module: str, default: float) -> float:
        key = next((k for k in patterns or {} if re.match(rf"(.*\.)?({k})$", module)), None)
        return float(patterns[key]) if key is not None else default

    def of(module: str) -> float:
        module = module.removeprefix("base_model.model.")
        r = pick(cfg.get("rank_pattern"), module, float(cfg["r"]))
        alpha = pick(cfg.get("alpha_pattern"), module, float(cfg.get("lora_alpha", cfg["r"])))
        return alpha / (r ** 0.5) if cfg.get("use_rslora") else alpha / r
    return of


class AdapterMerger:
    """Turns adapter tensors into merged HF weights `{module}.weight` of the served model."""

    def __init__(self, model_folder: str | Path) -> None:
        self.folder = Path(model_folder)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A": .., "B": ..}
        self._scaling: dict[str, float] = {}
        self._base: dict[str, torch.Tensor] = {}
        self._files: dict[str, Path] | None = None  # weight name -> safetensors file of the base model
        self.merged: dict[str, torch.Tensor] = {}  # latest merged weight per name (vLLM re-sends fused siblings)

    # ------------------------------------------------------------------ base weights
    def _index(self) -> dict[str, Path]:
        if self._files is None:
            from safetensors import safe_open

            files: dict[str, Path] = {}
            for f in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(f), framework="pt", device="cpu") as fh:
                    for k in fh.keys():
                        files[k] = f
            if not files:
                raise FileNotFoundError(f"no *.safetensors in the served model folder {str(self.folder)!r}: "
                                        "a LoRA push needs the base weights")
            self._files = files
        return self._files

    def base(self, name: str) -> torch.Tensor:
        """The base model's tensor `name` as stored in the model folder (cached)."""
        t = self._base.get(name)
        if t is None:
            from safetensors import safe_open

            f = self._index().get(name)
            if f is None:
                raise KeyError(f"LoRA adapter for {name!r}, which the base model at {str(self.folder)!r} does not have")
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                t = fh.get_tensor(name)
            self._base[name] = t
        return t

    def current(self, name: str) -> torch.Tensor:
        """What `name` holds now: its latest merge, else the base weight."""
        return self.merged[name] if name in self.merged else self.base(name)

    # ------------------------------------------------------------------ merging
    def add(self, named: list[tuple[str, torch.Tensor]], scaling: float) -> list[tuple[str, torch.Tensor]]:
        """Take adapter tensors; return `(weight name, W0 + s·B·A)` for every module whose A and B are both in."""
        out = []
        for name, tensor in named:
            m = _ADAPTER.match(name)
            if m is None:
                raise ValueError(f"{name!r} is not a LoRA adapter tensor (…lora_A.weight / …lora_B.weight)")
            module = m["module"]
            slot = self.pending.setdefault(module, {})
            slot[m["half"]] = tensor.detach().to("cpu")
            self._scaling[module] = float(scaling)
            if "A" in slot and "B" in slot:
                del self.pending[module]
                out.append(self._merge(module, slot["A"], slot["B"], self._scaling.pop(module)))
        return out

    def _merge(self, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> tuple[str, torch.Tensor]:
        name = f"{module}.weight"
        w0 = self.base(name)
        if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w0.shape):
            raise ValueError(f"LoRA shapes for {name}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not give the "
                             f"base weight's {tuple(w0.shape)}")
        merged = (w0.float() + scaling * (b.float() @ a.float())).to(w0.dtype)
        self.merged[name] = merged
        return name, merged

    def load_folder(self, folder: str | Path) -> list[tuple[str, torch.Tensor]]:
        """All merged weights of a peft adapter folder (adapter_config.json + *.safetensors), and the full
        weights of its `modules_to_save` (peft stores them as `base_model.model.<module>.weight`) under the
        base model's names."""
        from safetensors import safe_open

        folder = Path(folder)
        scaling_of = module_scalings(folder)
        by_scaling: dict[float, list[tuple[str, torch.Tensor]]] = {}  # a module's A and B share its scaling
        plain = []
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for k in fh.keys():
                    if (m := _ADAPTER.match(k)) is not None:
                        by_scaling.setdefault(scaling_of(m["module"]), []).append((k, fh.get_tensor(k)))
                    else:
                        plain.append((k.removeprefix("base_model.model."), fh.get_tensor(k)))
        merged = [w for s, named in by_scaling.items() for w in self.add(named, s)] + plain
        if self.pending:
            raise ValueError(f"adapter folder {str(folder)!r} lacks the other half of {sorted(self.pending)[:3]}")
        return merged
