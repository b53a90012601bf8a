"""`trainer/chunked_head.py`: the LM head + fp32 log-softmax chunk by chunk over tokens equals the unchunked
computation (logprobs, entropy, and the gradients w.r.t. the hidden states, the head weight and its bias), whatever
the chunk size, and its peak memory grows with the chunk, not with the tokens (counted by
trainer/tensor_memory.py)."""

import pytest
import torch
import torch.nn.functional as F

from rlstream.trainer.chunked_head import head_logprobs
from rlstream.trainer.tensor_memory import PeakTensorBytes

torch.set_num_threads(1)


def _unchunked(hidden, weight, bias, tokens, temperature):
    """The unchunked path of trainer/logprobs.py: `[N, V]` fp32 logits, autograd through everything."""
    z = F.linear(hidden, weight, bias).float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return logp, torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def _leaves(n=50, h=8, v=33, seed=0, bias=True, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (scale * torch.randn(v, h, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(v, generator=g)).requires_grad_() if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,), generator=g)


@pytest.mark.parametrize("chunk", [1, 7, 50, 64])
def test_chunked_logprobs_entropy_and_gradients_equal_the_unchunked_ones(chunk):
    hidden, weight, bias, tokens = _leaves()
    g = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(50, generator=g) / 50, torch.randn(50, generator=g) / 50  # per-token means
    leaves = (hidden, weight, bias)
    want_logp, want_ent = _unchunked(hidden, weight, bias, tokens, 0.7)
    want = torch.autograd.grad((want_logp * w_logp).sum() + (want_ent * w_ent).sum(), leaves)
    logp, ent = head_logprobs(hidden, weight, bias, tokens, temperature=0.7, chunk_tokens=chunk, with_entropy=True)
    got = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), leaves)
    torch.testing.assert_close(logp, want_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
    for name, a, b in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_with_sharp_logits_the_gradients_are_as_close_to_float64_as_the_unchunked_ones():
    """Logits spread over ±10: both fp32 computations round at ~1e-6 of the gradients' size; chunked and
    unchunked then differ by that rounding, not by more."""
    hidden, weight, bias, tokens = _leaves(scale=0.5)
    leaves = (hidden, weight, bias)
    wide = [x.detach().double().requires_grad_() for x in leaves]
    logp, ent = _unchunked(*wide, tokens, 0.7)
    exact = torch.autograd.grad(logp.sum() + ent.sum(), wide)
    logp, ent = _unchunked(hidden, weight, bias, tokens, 0.7)
    unchunked = torch.autograd.grad(logp.sum() + ent.sum(), leaves)
    logp, ent = head_logprobs(hidden, weight, bias, tokens, temperature=0.7, chunk_tokens=8, with_entropy=True)
    chunked = torch.autograd.grad(logp.sum() + ent.sum(), leaves)
    for ours, theirs, truth in zip(chunked, unchunked, exact):
        size = float(truth.abs().max())
        assert float((theirs.double() - truth).abs().max()) <= 5e-6 * size
        assert float((ours.double() - truth).abs().max()) <= 5e-6 * size


def test_gradients_of_the_logprobs_alone_and_of_the_entropy_alone():
    """A detached entropy (the statistic) sends no gradient; an unused logprob neither; no bias is fine."""
    hidden, weight, _, tokens = _leaves(n=20, bias=False)
    want_logp, want_ent = _unchunked(hidden, weight, None, tokens, 1.3)
    logp, ent = head_logprobs(hidden, weight, None, tokens, temperature=1.3, chunk_tokens=6, with_entropy=True)
    for ours, theirs in ((logp.sum() + ent.detach().sum(), want_logp.sum()), (ent.sum(), want_ent.sum())):
        got = torch.autograd.grad(ours, (hidden, weight), retain_graph=True)
        want = torch.autograd.grad(theirs, (hidden, weight), retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    logp, none = head_logprobs(hidden, weight, None, tokens, chunk_tokens=6)
    assert none is None and logp.requires_grad
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        head_logprobs(hidden, weight, None, tokens, chunk_tokens=0)


def test_bfloat16_head_matches_its_unchunked_computation():
    hidden, weight, bias, tokens = _leaves(n=40, h=16, v=64, seed=3)
    hidden, weight, bias = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight, bias))
    want_logp, _ = _unchunked(hidden, weight, bias, tokens, 1.0)
    want = torch.autograd.grad(want_logp.sum(), (hidden, weight, bias))
    logp, _ = head_logprobs(hidden, weight, bias, tokens, chunk_tokens=16)
    got = torch.autograd.grad(logp.sum(), (hidden, weight, bias))
    assert logp.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in got)
    torch.testing.assert_close(logp, want_logp, atol=1e-6, rtol=1e-6)  # forward: the same ops
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_peak_memory_of_the_pass_grows_with_the_chunk_not_with_the_tokens():
    """4096 tokens, forward + backward with the entropy: the unchunked pass holds several `[tokens, vocab]`
    fp32 tensors at once; the chunked one at most two `[chunk, vocab]` ones plus the gradients."""
    n, v, h, chunk = 4096, 2048, 16, 512
    hidden, weight, _, tokens = _leaves(n=n, h=h, v=v, bias=False)
    peaks, largest = {}, {}
    for name in ("unchunked", "chunked"):
        with PeakTensorBytes() as meter:
            if name == "chunked":
                logp, ent = head_logprobs(hidden, weight, None, tokens, chunk_tokens=chunk, with_entropy=True)
            else:
                logp, ent = _unchunked(hidden, weight, None, tokens, 1.0)
            (logp.sum() + ent.sum()).backward()
            del logp, ent
        peaks[name], largest[name] = meter.peak, meter.largest
        hidden.grad = weight.grad = None
    full = n * v * 4
    assert largest["unchunked"] == full and peaks["unchunked"] >= 3 * full
    assert largest["chunked"] == chunk * v * 4
    assert peaks["chunked"] <= 2 * chunk * v * 4 + 4 * (n * h + v * h) * 4
    assert peaks["unchunked"] >= 4 * peaks["chunked"]


def test_a_second_backward_through_the_same_graph_gives_the_same_gradients():
    """The backward keeps the last chunk's logits from the forward and overwrites them; a second backward
    (retain_graph) recomputes them and must agree."""
    hidden, weight, bias, tokens = _leaves(n=30)
    logp, ent = head_logprobs(hidden, weight, bias, tokens, temperature=0.7, chunk_tokens=8, with_entropy=True)
    loss = logp.mean() + ent.mean()
    first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, bias))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
