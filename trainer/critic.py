"""PPO's value model (`critic.*`): a causal-LM backbone with a scalar head, trained next to the actor.

The value model is the transformers `AutoModelForTokenClassification` of the backbone with one
label (what AReaL's `is_critic` builds): the backbone's weights from `critic.path` (actor.path
when unset), a random scalar head `score`. Per train step (trainer/ppo.py):

1. `values(batch)`: no-grad values of the batch before any update. For token t, the value of
   the state it is sampled in — the head's output at position t − 1, the same shift as the
   logprobs (trainer/logprobs.py) — and for each sequence the value after its last token;
2. GAE with these values (trainer/advantages.py) gives the advantages and the returns;
3. `train(batch, adv, old)`: `critic.ppo_n_minibatches` optimizer steps on AReaL's clipped value
   loss (`ppo_critic_loss_fn`): with v' = old + clip(v − old, ±eps_clip),
   loss_t = max(½(v − R)², ½(v' − R)²), averaged over the minibatch's loss tokens on all ranks.

Statistics (`critic/*`): the value loss (mean over minibatches), the clipped fraction, and of the
values the update started from: their mean, the returns' mean and the explained variance
1 − Var(R − V) / Var(R) over the loss tokens (1: values predict the returns, 0: no better than
their mean).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from rlstream.common.config import Config, ConfigError
from rlstream.trainer.advantages import Advantages, Values
from rlstream.trainer.batch import SeqBatch
from rlstream.trainer.logprobs import model_inputs, one_row_packing
from rlstream.trainer.loss_scale import computes_in_float16
from rlstream.trainer.microbatch import minibatch_slices
from rlstream.trainer.model import DTYPES, apply_lora, check_model_path, disable_dropout
from rlstream.trainer.optim import build_optimizer, build_scheduler
from rlstream.trainer.parallel import Parallel
from rlstream.trainer.update import MicroBatches

__all__ = ["Critic", "check_critic_config", "load_value_model", "value_loss", "ValueStats"]


def critic_path(cfg: Config) -> str:
    return (cfg.critic.path if cfg.critic is not None else None) or cfg.actor.path


def check_critic_config(cfg: Config) -> None:
    """At start, before any model loads: the backend, and an architecture that takes a scalar head."""
    if cfg.critic is None:
        return
    if cfg.actor.backend != "hf":
        raise ConfigError(f"critic needs actor.backend=hf (got {cfg.actor.backend!r}): the value model is a "
                          "transformers model")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    key = "critic.path" if cfg.critic.path else "actor.path (the critic's model: critic.path is unset)"
    folder = check_model_path(critic_path(cfg), key.split(" ")[0])
    model_type = AutoConfig.from_pretrained(folder, local_files_only=True).model_type
    if model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ConfigError(f"{key}={critic_path(cfg)}: a {model_type!r} model cannot take a scalar value head "
                          "(transformers has no ForTokenClassification class for it); use e.g. a Llama, Qwen2/3, "
                          "Mistral or GPT-2 model")


def load_value_model(cfg: Config, device: torch.device, pipeline: Any = None) -> torch.nn.Module:
    """The value model on `device`, trainable, in actor.dtype (dropout and checkpointing as the actor's); with a
    `pipeline` (trainer/pipeline_parallel.py) only this rank's stage of it."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    check_critic_config(cfg)
    c, a = cfg.critic, cfg.actor
    folder = check_model_path(critic_path(cfg), "critic.path")
    dtype = DTYPES[a.dtype]
    if c.init_from_scratch:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, num_labels=1)
        with torch.random.fork_rng():  # same seed on every rank: identical initial weights without a broadcast
            torch.manual_seed(cfg.seed)
            model = AutoModelForTokenClassification.from_config(config, dtype=dtype)
    else:
        with torch.random.fork_rng():  # the head's random init, the same on every rank
            torch.manual_seed(cfg.seed)
            model = AutoModelForTokenClassification.from_pretrained(folder, local_files_only=True, num_labels=1,
                                                                    dtype=dtype)
    if a.disable_dropout:
        disable_dropout(model)
    if c.lora is not None:
        model = apply_lora(model, c.lora, key="critic.lora", task_type="TOKEN_CLS", seed=cfg.seed)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    if pipeline is not None:
        pipeline.split(model)
    return model.to(device)


def value_loss(value: torch.Tensor, old_value: torch.Tensor, returns: torch.Tensor,
               eps_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and where the clipped term won (AReaL's ppo_critic_loss_fn, mse)."""
    value, old_value, returns = value.float(), old_value.float(), returns.float()
    plain = 0.5 * (value - returns).square()
    clipped_value = old_value + (value - old_value).clamp(-eps_clip, eps_clip)
    clipped = 0.5 * (clipped_value - returns).square()
    return torch.maximum(plain, clipped), clipped.detach() > plain.detach()


@dataclass
class ValueStats:
    """Sums over a step's loss tokens (this rank), reduced over ranks into the `critic/*` metrics."""

    n: float = 0.0
    values: float = 0.0
    returns: float = 0.0
    returns_sq: float = 0.0
    err: float = 0.0
    err_sq: float = 0.0

    @classmethod
    def of(cls, old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> ValueStats:
        m = mask.to(torch.float64)
        v, r = old.to(torch.float64) * m, returns.to(torch.float64) * m
        e = r - v
        return cls(float(m.sum()), float(v.sum()), float(r.sum()), float(r.square().sum()), float(e.sum()),
                   float(e.square().sum()))

    def metrics(self, par: Parallel) -> dict[str, float]:
        t = torch.tensor([self.n, self.values, self.returns, self.returns_sq, self.err, self.err_sq],
                         dtype=torch.float64)
        par.all_reduce([t], "sum")
        n, v, r, r2, e, e2 = (float(x) for x in t)
        if n == 0:
            return {}
        var_r = r2 / n - (r / n) ** 2
        var_e = e2 / n - (e / n) ** 2
        return {"critic/values_mean": v / n, "critic/returns_mean": r / n,
                "critic/explained_variance": 1.0 - var_e / var_r if var_r > 1e-12 else 0.0}


class Critic:
    """The value model, its optimizer and schedule; `values` before the actor's update, `train` after it."""

    def __init__(self, cfg: Config, par: Parallel, total_steps: int, pad_token_id: int = 0) -> None:
        self.c = cfg.critic
        self.par = par
        self.pad_token_id = pad_token_id
        self.model = par.wrap(load_value_model(cfg, par.device, par.pipeline), cfg.actor.grad_reduce_dtype,
                              cfg.actor.fsdp)
        # the value model is held in actor.dtype and runs without autocast
        self.optimizer = build_optimizer(self.model.parameters(), self.c.optimizer,
                                         float16=computes_in_float16(cfg.actor.dtype))
        self.scheduler = build_scheduler(self.optimizer, self.c.optimizer, total_steps)
        self.micro = MicroBatches(par, self.c.mb_spec, pad_token_id)

    def _forward(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """([T] value of the state each token is sampled in (0 at sequence starts), [N] value after each sequence)."""
        dtype = next(self.model.parameters()).dtype
        inputs = model_inputs(batch, self.c.mb_spec.packing, self.pad_token_id, one_row_packing(self.model),
                              dtype).to(self.par.device)
        head = self.model(**inputs.kwargs, use_cache=False).logits.float().reshape(-1)[inputs.flat_index]
        starts = batch.cu_seqlens[:-1].to(self.par.device)
        tokens = torch.roll(head, shifts=1, dims=0).index_fill(0, starts, 0.0)
        return tokens, head[batch.cu_seqlens[1:].to(self.par.device) - 1]

    @torch.no_grad()
    def values(self, batch: SeqBatch) -> Values:
        """The values the step's advantages use (the weights before this step's update)."""
        was_training = self.model.training
        self.model.eval()
        tokens, last = torch.zeros(batch.n_tokens), torch.zeros(batch.n_seqs)
        for seqs in self.micro.each(self.model, batch.seq_lens.tolist()):
            tok_v, last_v = self._forward(batch.select(seqs))
            tokens[batch.token_index(seqs)] = tok_v.cpu()
            last[seqs] = last_v.cpu()
        self.model.train(was_training)
        return Values(tokens, last)

    def train(self, batch: SeqBatch, adv: Advantages, old: Values) -> dict[str, float]:
        """`critic.ppo_n_minibatches` optimizer steps towards `adv.returns`; the step's `critic/*` metrics."""
        t0 = time.perf_counter()
        lr = float(self.scheduler.get_last_lr()[0])
        max_norm = self.c.optimizer.gradient_clipping or math.inf
        sums = torch.zeros(4, dtype=torch.float64)  # loss (per minibatch mean), clipped tokens, loss tokens, grad norm
        minibatches = minibatch_slices(batch.n_seqs, self.c.ppo_n_minibatches)
        all_skipped = True
        for mb_seqs in minibatches:
            tok = batch.token_index(mb_seqs)
            denom = adv.loss_mask[tok].sum().to(torch.float64).reshape(1)
            self.par.all_reduce([denom], "sum")
            denom = max(float(denom), 1.0)

            micro_loss = partial(self._micro_loss, batch, adv=adv, old=old, denom=denom, sums=sums)
            # A non-finite gradient skips the minibatch, as the actor's would be skipped.
            grad_norm, skipped = self.micro.optimizer_step(self.model, self.optimizer, mb_seqs, batch.seq_lens,
                                                           micro_loss, max_norm)
            all_skipped = all_skipped and skipped
            sums[3] += grad_norm / self.par.dp_size  # the same on every rank: summed back to it below
        if not all_skipped:  # as the actor's: a step that changed no weight leaves the schedule where it is
            self.scheduler.step()
        self.par.all_reduce([sums], "sum")
        stats = ValueStats.of(old.tokens, adv.returns, adv.loss_mask).metrics(self.par)
        return stats | {"critic/value_loss": float(sums[0]) / len(minibatches),
                        "critic/clip_frac": float(sums[1]) / max(float(sums[2]), 1.0),
                        "critic/grad_norm": float(sums[3]) / len(minibatches), "critic/lr": lr,
                        "time/critic_update": time.perf_counter() - t0}

    def _micro_loss(self, batch: SeqBatch, seqs: list[int], *, adv: Advantages, old: Values, denom: float,
                    sums: torch.Tensor) -> torch.Tensor:
        """The clipped value loss of `seqs` over the minibatch's `denom` loss tokens; adds to the step's `sums`."""
        idx = batch.token_index(seqs)
        value, _ = self._forward(batch.select(seqs))
        mask = adv.loss_mask[idx].to(value.device)
        tok_loss, clip = value_loss(value, old.tokens[idx].to(value.device), adv.returns[idx].to(value.device),
                                    self.c.eps_clip)
        loss = torch.where(mask, tok_loss, 0.0).sum() / denom
        sums += torch.tensor([float(loss.detach()), float((clip & mask).sum()), float(mask.sum()), 0.0],
                             dtype=torch.float64)
        return loss
