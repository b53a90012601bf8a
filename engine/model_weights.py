"""The served HF model's weights as the local engine changes them: copy named tensors in, read them from disk.

`engine/weights.py` receives updates (HTTP routes, collectives, IPC, deltas) and hands
the tensors to `LocalEngine.apply_weights`, which copies them in here between two decode
steps. LoRA adapter tensors are merged into the base weights first (`engine/lora.py`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlstream.engine.lora import ADAPTER_CONFIG, AdapterMerger, is_adapter_tensor

__all__ = ["ModelWeights"]


class ModelWeights:
    """Every parameter and buffer of `model` by HF name, tied aliases included."""

    def __init__(self, model: torch.nn.Module, model_path: str, quantized: dict[str, Any] | None = None) -> None:
        self.model_path = model_path
        self.named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self.named.update(dict(model.named_buffers(remove_duplicate=False)))
        # weights served quantized (engine/quantization.py), by HF weight name: a tensor pushed under that name is
        # quantized into its layer; they are not in `named`, which holds tensors served as they are pushed
        self.quantized = quantized or {}
        for name in self.quantized:
            for buffer in ("qweight", "scale"):
                del self.named[name.removesuffix("weight") + buffer]
        self._merger: AdapterMerger | None = None  # made at the first LoRA push

    def merger(self) -> AdapterMerger:
        if self._merger is None:
            self._merger = AdapterMerger(self.model_path)
        return self._merger

    def copy_in(self, named_tensors: Iterable[tuple[str, torch.Tensor]], lora_scaling: float | None) -> int:
        """Copy tensors into the weights of the same name (the caller holds off decode steps); returns how many.

        Raises KeyError for an unknown name and ValueError for a shape mismatch (tensors
        before the bad one are already copied). Adapter tensors (`…lora_A.weight` /
        `…lora_B.weight`) are merged with `lora_scaling` and the merged weights copied.
        """
        n = 0
        with torch.no_grad():
            for name, tensor in self._merged(named_tensors, lora_scaling):
                dst = self.named.get(name)
                if dst is None and name in self.quantized:
                    layer = self.quantized[name]
                    if tuple(layer.weight_shape) != tuple(tensor.shape):
                        raise ValueError(f"parameter {name!r}: shape {tuple(tensor.shape)} does not match the "
                                         f"served model's {tuple(layer.weight_shape)}")
                    layer.load(tensor)
                    n += 1
                    continue
                if dst is None:
                    raise KeyError(f"unknown parameter {name!r} for the served model {self.model_path!r}")
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"parameter {name!r}: shape {tuple(tensor.shape)} does not match the "
                                     f"served model's {tuple(dst.shape)}")
                dst.copy_(tensor)
                n += 1
        return n

    def _merged(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                lora_scaling: float | None) -> Iterator[tuple[str, torch.Tensor]]:
        """The plain tensors as they come, then the weights merged from the adapter tensors among them."""
        adapters: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named_tensors:
            if is_adapter_tensor(name):
                adapters.append((name, tensor))
                continue
            yield name, tensor
        if adapters:
            if lora_scaling is None:
                raise ValueError(f"LoRA adapter tensors ({adapters[0][0]}, ...) came without lora_scaling")
            yield from self.merger().add(adapters, lora_scaling)

    def read_disk(self, path: str | os.PathLike) -> tuple[Iterable[tuple[str, torch.Tensor]], bool]:
        """The tensors of a .safetensors file, of every *.safetensors of an HF folder, or of a LoRA adapter
        folder merged into the base weights; and whether it was an adapter folder."""
        p = Path(path)
        if p.is_dir() and (p / ADAPTER_CONFIG).is_file():  # a LoRA adapter folder (peft format)
            return self.merger().load_folder(p), True
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(Path(f) for f in glob.glob(str(p / "*.safetensors")))
        else:
            raise FileNotFoundError(f"weights path {str(p)!r} does not exist")
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {str(p)!r}")
        return _safetensors(files), False


def _safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)
