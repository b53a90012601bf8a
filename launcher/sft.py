"""`rlstream sft`: a short supervised warm start of `actor.path` before RL.

Trains the causal LM at `actor.path` for `launcher.sft_steps` Adam steps (or `sft_epochs` passes; lr
`launcher.sft_lr`, or the full `launcher.sft_optimizer`; `launcher.sft_batch_size` sequences a step) on prompt/answer rows of
`launcher.sft_dataset` (empty: `train_dataset.path`), with the loss on the answer tokens
and EOS only. Rows holding a `messages` list are whole multi-turn conversations
(assistant turns, tool results), tokenized exactly as `AgentWorkflow` builds episodes
(`ChatTemplate.conversation`), with the loss on the assistant turns. Prompts are tokenized by the producer's own `PromptDataset`, so the
warm-started model sees exactly the token ids it will be prompted with during RL.

With `launcher.demo.task` set, the demo's data and tiny model are generated first when
missing (so `rlstream sft --config configs/tiny-cpu.yaml` works on a fresh checkout).

A vision-language `actor.path` (docs/multimodal.md) learns from rows with images the same way: the prompt's
image tokens come from `PromptDataset`, the images go with each batch as `pixel_values` / `image_grid_thw`.

The result replaces the weights at `actor.path` (written next to it, then moved in)
and a marker `rlstream_sft.json` records what was done: a second `rlstream sft` or
`rlstream run` on the same model is a no-op instead of a second warm start.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path

from rlstream.common.config import Config, DatasetConfig
from rlstream.common.logging import get_logger
from rlstream.common.models import dtype_kwargs

__all__ = ["sft", "SFT_MARKER", "sft_done"]

log = get_logger(__name__)

SFT_MARKER = "rlstream_sft.json"


def sft_done(model_path: str | Path) -> dict | None:
    """The marker of an earlier warm start of this model, if any."""
    marker = Path(model_path) / SFT_MARKER
    if marker.exists():
        return json.loads(marker.read_text())
    return None


def _conversations(cfg: Config, tokenizer, path: str) -> list[tuple[list[int], list[int]]] | None:
    """Multi-turn demonstrations (JSONL rows with a `messages` list), tokenized the way
    `AgentWorkflow` builds episodes (tools from `agent.tools`); None if the file has none."""
    from rlstream.producer.chat import ChatTemplate
    from rlstream.producer.tools import load_tools

    p = Path(path)
    if not p.is_file() or p.suffix != ".jsonl":
        return None
    with open(p) as f:
        first = f.readline()
    if not first.strip() or "messages" not in json.loads(first):
        return None
    chat = ChatTemplate.of_config(cfg, tokenizer, [t.schema for t in load_tools(cfg).values()])
    out = []
    with open(p) as f:
        for line in f:
            if line.strip():
                ids, mask = chat.conversation(json.loads(line)["messages"])
                out.append((ids, mask))
    return out


def _examples(cfg: Config, tokenizer) -> list[tuple[list[int], list[int], tuple[bytes, ...]]]:
    """(token ids, loss mask, images) for every demonstration row: prompt + answer + EOS with the loss
    on the answer and EOS, or a whole conversation with the loss on the assistant turns."""
    from rlstream.common.vision import actor_vision
    from rlstream.producer.dataset import PromptDataset

    path = cfg.launcher.sft_dataset or cfg.train_dataset.path
    key = "launcher.sft_dataset" if cfg.launcher.sft_dataset else "train_dataset"
    convs = _conversations(cfg, tokenizer, path)
    if convs is not None:
        return [(ids, mask, ()) for ids, mask in convs]
    dcfg = DatasetConfig(path=path, type=cfg.train_dataset.type, prompt_key=cfg.train_dataset.prompt_key,
                         answer_key=cfg.train_dataset.answer_key, image_key=cfg.train_dataset.image_key,
                         apply_chat_template=cfg.train_dataset.apply_chat_template, shuffle=False,
                         max_prompt_len=cfg.train_dataset.max_prompt_len)
    ds = PromptDataset(dcfg, tokenizer, seed=cfg.seed, key=key, vision=actor_vision(cfg), image_limits=cfg.images)
    if not ds.has_answer:
        raise ValueError(f"{key}.path={path!r} has no {cfg.train_dataset.answer_key!r} column to learn from")
    eos = tokenizer.eos_token_id
    out = []
    for i in range(len(ds)):
        item = ds.at(i)
        ans = list(tokenizer(str(item.answer), add_special_tokens=False)["input_ids"]) + [eos]
        out.append((list(item.input_ids) + ans, [0] * len(item.input_ids) + [1] * len(ans), item.images))
    return out


def _image_kwargs(spec, batch: list[tuple[list[int], list[int], tuple[bytes, ...]]], cache: dict) -> dict:
    """`pixel_values` / `image_grid_thw` of a batch's images in row order (each image preprocessed once)."""
    import torch

    from rlstream.common.images import image_sha256
    from rlstream.common.vision import image_inputs

    images = []
    for _, _, row_images in batch:
        for data in row_images:
            sha = image_sha256(data)
            if sha not in cache:
                cache[sha] = image_inputs(spec, data)
            images.append(cache[sha])
    if not images:
        return {}
    return {"pixel_values": torch.cat([im.pixel_values for im in images]),
            "image_grid_thw": torch.stack([im.grid for im in images])}


def sft(cfg: Config) -> dict | None:
    """Entry of `rlstream sft --config X`; returns the marker written (None when skipped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from rlstream.common.vision import actor_vision

    from rlstream.launcher.demo import prepare
    from rlstream.trainer.model import disable_dropout
    from rlstream.trainer.optim import OptimizerStepper
    from rlstream.trainer.parallel import fsdp_units

    lc = cfg.launcher
    if lc.sft_steps == 0 and lc.sft_epochs == 0:
        log.info("launcher.sft_steps=0 and sft_epochs=0: no warm start")
        return None
    prepare(cfg)  # the demo task's data and model, when configured and missing
    model_path = Path(cfg.actor.path)
    if not cfg.actor.path or not (model_path / "config.json").exists():
        raise ValueError(f"actor.path={cfg.actor.path!r} is not a local HF model folder (no config.json)")
    done = sft_done(model_path)
    if done is not None:
        log.info("%s was already warm-started (%d steps, see %s); delete that file to redo it", model_path,
                 done.get("steps", 0), SFT_MARKER)
        return None

    # One thread: with several processes on 2 cores, OpenMP spinning in more threads costs 10-50x.
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    vision = actor_vision(cfg)
    model_class = AutoModelForCausalLM if vision is None else AutoModelForImageTextToText
    model = model_class.from_pretrained(model_path, **dtype_kwargs(torch.float32))
    if cfg.actor.disable_dropout:
        disable_dropout(model)
    fsdp_key = "launcher.sft_fsdp" if lc.sft_fsdp is not None else "actor.fsdp"
    units = fsdp_units(model, lc.sft_fsdp or cfg.actor.fsdp, fsdp_key)  # one process: checked, nothing to shard
    log.info("warm start in one process: %s's %d FSDP2 unit(s) (%s) shard nothing", fsdp_key, len(units),
             ", ".join(sorted({type(u).__name__ for u in units})) or "none")
    if cfg.actor.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    examples = _examples(cfg, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    steps = lc.sft_steps or math.ceil(lc.sft_epochs * len(examples) / lc.sft_batch_size)
    # float16 compute (autocast over the float32 weights) scales the loss (trainer/loss_scale.py)
    float16 = "float16" in (cfg.actor.dtype, cfg.actor.compute_dtype)
    stepper = OptimizerStepper(model.parameters(), lc.sft_optimizer, lc.sft_lr, steps, float16=float16)
    t0 = time.monotonic()
    last = t0
    loss_val = float("nan")
    preprocessed: dict = {}
    skipped = 0
    for step in range(1, steps + 1):
        batch = [examples[rng.randrange(len(examples))] for _ in range(lc.sft_batch_size)]
        width = max(len(seq) for seq, _, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (seq, mask, _) in enumerate(batch):
            t = torch.tensor(seq)
            ids[r, : len(seq)] = t
            labels[r, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, -100)  # model turns only
            attn[r, : len(seq)] = 1
        extra = _image_kwargs(vision, batch, preprocessed) if vision is not None else {}
        with torch.autocast("cpu", torch.float16, enabled=float16):
            loss = model(input_ids=ids, attention_mask=attn, labels=labels, **extra).loss
        metrics = stepper.step(loss)
        skipped += int(metrics["skipped"])
        loss_val = float(loss.item())
        if time.monotonic() - last > 5 or step == steps or metrics["skipped"]:
            last = time.monotonic()
            log.info("sft step %d/%d loss %.4f%s%s (%.1fs)", step, steps, loss_val,
                     " skipped (inf/nan gradients)" if metrics["skipped"] else "",
                     f" loss_scale {metrics['loss_scale']:g}" if "loss_scale" in metrics else "", last - t0)

    # Write next to the model, then move the files in: a crash never leaves a half-written model.
    tmp = model_path.with_name(model_path.name + ".sft-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tmp.iterdir():
        os.replace(f, model_path / f.name)
    tmp.rmdir()
    marker = {"steps": steps, "lr": lc.sft_optimizer.lr if lc.sft_optimizer else lc.sft_lr, "batch_size": lc.sft_batch_size, "final_loss": loss_val,
              "examples": len(examples), "seconds": round(time.monotonic() - t0, 2),
              "data": cfg.launcher.sft_dataset or cfg.train_dataset.path, "skipped_steps": skipped,
              "fsdp_units": len(units)} | ({"loss_scale": metrics["loss_scale"]} if "loss_scale" in metrics else {})
    (model_path / SFT_MARKER).write_text(json.dumps(marker, indent=2))
    log.info("warm start done: %d steps, final loss %.4f, %.1fs -> %s", steps, loss_val, marker["seconds"],
             model_path)
    return marker
