"""The LM head and the fp32 log-softmax over the vocabulary, chunk by chunk over tokens.

`head_logprobs(hidden, weight, bias, tokens)` returns, for each row of `hidden` (the final
hidden state that predicts a token), `log_softmax((hidden @ weight.T + bias).float() / T)[token]`
and optionally the entropy of that distribution, without ever holding the `[tokens, vocab]`
logits: the forward computes the logits of `chunk_tokens` rows at a time and keeps only
their log-sum-exp; the backward recomputes each chunk's logits from the hidden states and
the head weight and turns them at once into the chunk's gradients w.r.t. the hidden states,
the weight and the bias. Peak memory of the pass then grows with `chunk_tokens × vocab`,
not `tokens × vocab` (with a 49k vocabulary, fp32 logits are 0.2 MB per token, and the
unchunked pass holds several such tensors: logits, tempered logits, exp, softmax).

This is the "fused linear + cross-entropy" method of Liger-Kernel (its fused linear cross
entropy chunks the tokens and computes the gradient in the forward) and of Apple's
Cut Your Losses in Large-Vocabulary Language Models (cut-cross-entropy, which also blocks
over the vocabulary inside one kernel). Liger can form the gradient in the forward because
its loss is the cross-entropy itself; here the logprobs feed the PPO loss, whose gradient
w.r.t. them is known only in the backward, so the backward recomputes each chunk's logits
but the last, which the forward leaves it (one more LM-head matmul per token beyond the first
chunk: ~5% of a SmolLM2-135M step's FLOPs; none when a micro-batch's outputs fit one chunk). The ops are those
of the unchunked path, so the numbers equal it (tests/trainer/test_chunked_head.py).

Gradient of the tempered logits z of one row, with p = softmax(z):
d logp[token] / dz = onehot(token) - p,  d entropy / dz = -p * (z - Σ p z).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["head_logprobs"]


def _tempered_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """`[rows, vocab]` fp32 logits / T: the LM head in the model's dtype, then fp32, as the unchunked path does."""
    return F.linear(h, weight, bias).float() / temperature


class _ChunkedHeadLogSoftmax(torch.autograd.Function):
    """(hidden, weight, bias, tokens) -> ([N] logp, [N] entropy or [0]); see the module docstring.

    At most two `[chunk, vocab]` fp32 tensors are alive at once (the logits and their softmax),
    forward and backward: the other steps work in place.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        mean_z = torch.empty_like(ent)  # Σ p z per row, for the entropy's gradient
        z = None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = None  # the previous chunk's logits go before the next chunk's come
            z = _tempered_logits(hidden[s:e], weight, bias, temperature)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logp[s:e] = z.gather(-1, tokens[s:e, None]).squeeze(-1) - lse[s:e]
            if with_entropy:  # the unchunked path's ops, the product in place
                mean_z[s:e] = torch.softmax(z, dim=-1).mul_(z).sum(-1)
                ent[s:e] = lse[s:e] - mean_z[s:e]
        # The last chunk's logits stay for the backward, which then recomputes one chunk fewer (all of
        # them when the micro-batch is one chunk); the peak stays within two chunks.
        ctx.last_logits = z if n and any(ctx.needs_input_grad[:3]) else None
        del z
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, mean_z)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, tokens, lse, mean_z = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.zeros_like(hidden) if need_h else None
        # fp32 accumulation over chunks (a low-precision weight would otherwise round at every chunk).
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_b = torch.zeros_like(bias) if need_b and bias is not None else None
        if g_ent is not None and mean_z.numel() == 0:
            g_ent = None
        n = hidden.shape[0] if g_logp is not None or g_ent is not None else 0
        for s in reversed(range(0, n, ctx.chunk)):  # the kept last chunk first: it is freed before the others come
            e = min(n, s + ctx.chunk)
            z = None
            if e == n and ctx.last_logits is not None:
                z, ctx.last_logits = ctx.last_logits, None  # used up (overwritten): a second backward recomputes
            else:
                z = _tempered_logits(hidden[s:e], weight, bias, ctx.temperature)
            g_logits = _chunk_logits_grad(z, lse[s:e],
                                          tokens[s:e], None if g_logp is None else g_logp[s:e],
                                          None if g_ent is None else (g_ent[s:e], mean_z[s:e]), ctx.temperature)
            g_logits = g_logits.to(hidden.dtype)
            if need_h:
                g_h[s:e] = g_logits @ weight
            if need_w:
                g_w.addmm_(g_logits.t().float(), hidden[s:e].float())
            if g_b is not None:
                g_b += g_logits.sum(0)
            del g_logits, z
        return g_h, (g_w.to(weight.dtype) if need_w else None), g_b, None, None, None, None


def _chunk_logits_grad(z: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor, g_logp: torch.Tensor | None,
                       g_ent: tuple[torch.Tensor, torch.Tensor] | None, temperature: float) -> torch.Tensor:
    """d loss / d logits of one chunk, from its tempered logits `z` (overwritten); `g_ent`: (grad, Σ p z).

    = -p * (g_logp + g_ent * (z - Σ p z)) + g_logp * onehot(token), divided by T.
    """
    p = (z - lse[:, None]).exp_()
    if g_ent is not None:
        g, mean_z = g_ent
        coef = z.sub_(mean_z[:, None]).mul_(g[:, None])
        if g_logp is not None:
            coef.add_(g_logp[:, None])
        p.mul_(coef).neg_()
    else:
        p.mul_(-g_logp[:, None])
    if g_logp is not None:
        p.scatter_add_(-1, tokens[:, None], g_logp[:, None])
    return p.div_(temperature)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor, *,
                  temperature: float = 1.0, chunk_tokens: int = 1024,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`([N] fp32 logprob of tokens[i] under row i of hidden, [N] fp32 entropy or None)`.

    `hidden` `[N, H]` (the rows that predict `tokens`), `weight` `[V, H]` and `bias` `[V]` of the LM
    head; differentiable w.r.t. all three, the entropy too. `chunk_tokens` rows at a time.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logp, ent = _ChunkedHeadLogSoftmax.apply(hidden, weight, bias, tokens, float(temperature), int(chunk_tokens),
                                             with_entropy)
    return logp, (ent if with_entropy else None)
