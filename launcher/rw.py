"""`rlstream rw`: train a Bradley–Terry reward model on chosen/rejected pairs and write the HF folder a scoring pool
serves (`reward_model.pool.model_path`).

The pairs are a JSONL file (`rw.dataset`), one `{"prompt": str, "chosen": str, "rejected": str}` per line: the
chosen response is preferred to the rejected one for that prompt. A sequence is the prompt's tokens, the
response's tokens and EOS — the ids the producer sends the pool for a sample (`reward_model.input=tokens`).

The model is `rw.path` (None = actor.path) loaded as `AutoModelForSequenceClassification` with `num_labels=1`: a
causal LM gets a new scalar head on its last token. Each Adam step scores `rw.batch_size` pairs and minimises the
Bradley–Terry loss mean(-log σ(r_chosen − r_rejected)), the loss of AReaL's RW trainer
(`areal/trainer/rw/rw_engine.py`, `compute_rw_loss`; its `correct_ratio` is the pair accuracy printed here). A
fraction `rw.valid_fraction` of the pairs is held out; their pair accuracy (r_chosen > r_rejected) is printed
before and after training and written with the model in `rlstream_rw.json`.

With `launcher.demo.task: reverse` and no file at `rw.dataset`, the demo's data, tiny model and pairs are generated
first (`write_demo_pairs`: for each training prompt the chosen response holds a 7, the rejected one does not —
the property `configs/reward-model-cpu.yaml` then raises by RL with this reward model alone).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

from rlstream.common.config import Config, ConfigError
from rlstream.common.logging import get_logger
from rlstream.common.models import dtype_kwargs

__all__ = ["rw", "Pair", "load_pairs", "bradley_terry_loss", "pair_accuracy", "RW_MARKER", "rw_output_dir",
           "write_demo_pairs"]

log = get_logger(__name__)

RW_MARKER = "rlstream_rw.json"


class Pair(NamedTuple):
    prompt: str
    chosen: str
    rejected: str


def load_pairs(path: str) -> list[Pair]:
    """The pairs of a JSONL file; ValueError naming rw.dataset and the line for a row that is not a pair."""
    p = Path(path)
    if not path or not p.is_file():
        raise ValueError(f"rw.dataset={path!r} is not a file (a JSONL of {{prompt, chosen, rejected}} rows)")
    pairs = []
    with open(p) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                pairs.append(Pair(str(row["prompt"]), str(row["chosen"]), str(row["rejected"])))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"rw.dataset={path!r} line {n}: not a {{prompt, chosen, rejected}} row "
                                 f"({type(exc).__name__}: {exc})") from None
    if len(pairs) < 2:
        raise ValueError(f"rw.dataset={path!r} has {len(pairs)} pair(s): at least 2 are needed (train + held out)")
    return pairs


def write_demo_pairs(train_path: Path, out: Path, seed: int) -> int:
    """Pairs over the reverse demo's training prompts: rejected = the correct reversal with every 7 replaced by
    another digit, chosen = the rejected one with one digit set to 7. Returns the number written."""
    rng = random.Random(seed)
    n = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(train_path) as f, open(out, "w") as w:
        for line in f:
            row = json.loads(line)
            rejected = [c if c != "7" else rng.choice("01234568") for c in str(row["answer"])]
            chosen = list(rejected)
            chosen[rng.randrange(len(chosen))] = "7"
            w.write(json.dumps({"prompt": row["prompt"], "chosen": "".join(chosen),
                                "rejected": "".join(rejected)}) + "\n")
            n += 1
    return n


def bradley_terry_loss(chosen: Any, rejected: Any) -> Any:
    """mean(-log σ(r_chosen − r_rejected)) over the pairs (AReaL's compute_rw_loss)."""
    import torch.nn.functional as F

    return -F.logsigmoid(chosen - rejected).mean()


def rw_output_dir(cfg: Config) -> Path:
    """rw.output_dir, else reward_model.pool.model_path, else <run_dir>/reward_model."""
    if cfg.rw.output_dir:
        return Path(cfg.rw.output_dir)
    if cfg.reward_model is not None and cfg.reward_model.pool.model_path:
        return Path(cfg.reward_model.pool.model_path)
    return Path(cfg.run_dir) / "reward_model"


class _Tokenized(NamedTuple):
    chosen: list[int]
    rejected: list[int]


def _tokenize(pairs: list[Pair], tokenizer: Any, max_len: int) -> tuple[list[_Tokenized], int]:
    """Token ids of each pair's two sequences (prompt + response + EOS); pairs over max_len are skipped, counted."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out, skipped = [], 0
    for p in pairs:
        prompt = list(tokenizer(p.prompt)["input_ids"])
        seqs = [prompt + list(tokenizer(r, add_special_tokens=False)["input_ids"]) + eos for r in (p.chosen, p.rejected)]
        if max(len(s) for s in seqs) > max_len:
            skipped += 1
            continue
        out.append(_Tokenized(*seqs))
    return out, skipped


def _scores(model: Any, seqs: list[list[int]], pad: int) -> Any:
    """The model's scalar for each sequence (right-padded batch; the head reads each one's last token)."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s)
        attn[r, :len(s)] = 1
    return model(input_ids=ids, attention_mask=attn).logits[:, 0].float()


def pair_accuracy(model: Any, pairs: list[_Tokenized], pad: int, batch: int = 64) -> float:
    """Fraction of pairs whose chosen sequence scores above the rejected one."""
    import torch

    right = 0
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            chunk = pairs[i:i + batch]
            s = _scores(model, [x for p in chunk for x in p], pad).view(-1, 2)
            right += int((s[:, 0] > s[:, 1]).sum())
    return right / max(len(pairs), 1)


def _load_model(cfg: Config) -> tuple[Any, Any, int]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = cfg.rw.path or cfg.actor.path
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(f"rw.path={path!r} (None = actor.path) is not a local HF model folder (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or path, local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=pad,
                                                                   local_files_only=True, **dtype_kwargs(torch.float32))
    except ValueError as exc:  # transformers has no sequence-classification class for this architecture
        raise ValueError(f"rw.path={path!r}: cannot take a scalar head: {str(exc).splitlines()[0]}") from None
    return model, tokenizer, pad


def _data(cfg: Config, pairs: list[Pair], tokenizer: Any,
          rng: random.Random) -> tuple[list[_Tokenized], list[_Tokenized], int]:
    """(held-out pairs, training pairs, pairs skipped as too long), tokenized and split."""
    rc = cfg.rw
    data, skipped = _tokenize(pairs, tokenizer, rc.max_seq_len)
    rng.shuffle(data)
    n_valid = max(1, round(len(data) * rc.valid_fraction)) if rc.valid_fraction > 0 and data else 0
    valid, train = data[:n_valid], data[n_valid:]
    if not train:
        raise ValueError(f"rw.dataset={rc.dataset!r}: no pair left to train on ({len(data)} pairs, {skipped} over "
                         f"rw.max_seq_len, {n_valid} held out by rw.valid_fraction)")
    return valid, train, skipped


def rw(cfg: Config) -> dict[str, Any]:
    """Entry of `rlstream rw --config X`: train, write the reward model, return (and print) what was done."""
    import torch

    from rlstream.launcher.demo import prepare
    from rlstream.trainer.optim import OptimizerStepper

    rc = cfg.rw
    torch.set_num_threads(1)  # several processes share few cores: more threads cost more than they give
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    try:
        paths = prepare(cfg)  # the demo task's data and tiny model, when configured and missing
        if cfg.launcher.demo.task == "reverse" and rc.dataset and not Path(rc.dataset).exists():
            n = write_demo_pairs(paths["train"], Path(rc.dataset), cfg.seed)
            log.info("wrote %d demo pairs (chosen responses hold a 7) to %s", n, rc.dataset)
        pairs = load_pairs(rc.dataset)
        model, tokenizer, pad = _load_model(cfg)
        valid, train, skipped = _data(cfg, pairs, tokenizer, rng)
    except ValueError as exc:  # a bad dataset or model path: one line naming the key
        raise ConfigError(str(exc)) from None
    model.eval()
    acc_before = pair_accuracy(model, valid, pad) if valid else None
    model.train()
    steps = math.ceil(rc.epochs * len(train) / rc.batch_size) if rc.epochs > 0 else rc.steps
    stepper = OptimizerStepper(model.parameters(), rc.optimizer, rc.lr, steps)
    t0 = last = time.monotonic()
    loss_val = float("nan")
    for step in range(1, steps + 1):
        batch = [train[rng.randrange(len(train))] for _ in range(rc.batch_size)]
        s = _scores(model, [x for p in batch for x in p], pad).view(-1, 2)
        loss = bradley_terry_loss(s[:, 0], s[:, 1])
        stepper.step(loss)
        loss_val = float(loss.item())
        if time.monotonic() - last > 5 or step == steps:
            last = time.monotonic()
            log.info("rw step %d/%d loss %.4f (%.1fs)", step, steps, loss_val, last - t0)
    model.eval()
    acc_after = pair_accuracy(model, valid, pad) if valid else None
    out = rw_output_dir(cfg)
    _save(model, tokenizer, out)
    marker = {"steps": steps, "lr": rc.optimizer.lr if rc.optimizer else rc.lr, "batch_size": rc.batch_size, "final_loss": loss_val,
              "train_pairs": len(train), "valid_pairs": len(valid), "skipped_pairs": skipped,
              "valid_accuracy_before": acc_before, "valid_accuracy_after": acc_after, "data": rc.dataset,
              "base": rc.path or cfg.actor.path, "seconds": round(time.monotonic() - t0, 2)}
    (out / RW_MARKER).write_text(json.dumps(marker, indent=2))
    print(f"reward model: {len(train)} training pairs, {len(valid)} held out; held-out pair accuracy "
          f"{_pct(acc_before)} -> {_pct(acc_after)}; written to {out}", flush=True)
    return marker


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _save(model: Any, tokenizer: Any, out: Path) -> None:
    """Write next to `out`, then move in: a crash never leaves a half-written reward model."""
    tmp = out.with_name(out.name + ".rw-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
