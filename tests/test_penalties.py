"""Presence, frequency and repetition penalties and logit biases (runtime/sampling.py): the host rule against its definition
token by token, the device state against the host rule, and a Session's tokens (prefill's first token on the
host, decode steps on the device, pipelined or one at a time) against the host rule applied to the logits each
request sampled from. MTP refuses them, naming the field."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model, randomize_
from dsv4c.runtime.sampling import PenaltyState, SamplingParams, penalize, sample_at
from session_probe import eager_session, serve

P = SamplingParams(0.8, presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.3,
                   logit_bias=((3, 2.5), (7, -100.0)))


def by_definition(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    x = logits.float().clone()
    for t, b in p.logit_bias:  # the bias first
        x[t] += b
    for t in range(x.shape[0]):
        if t in prompt or t in out:  # repetition: the prompt's and the output's tokens
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = out.count(t)  # frequency and presence: the output's
        x[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return x


def test_the_host_rule_is_the_definition_and_the_device_state_is_the_host_rule():
    g = torch.Generator().manual_seed(0)
    V, rows = 23, []
    for b in range(4):
        prompt = torch.randint(0, V, (5 + b,), generator=g).tolist()
        out = torch.randint(0, V, (b * 3,), generator=g).tolist()
        rows.append((torch.randn(V, generator=g) * 3, prompt, out))
    for logits, prompt, out in rows:
        torch.testing.assert_close(penalize(logits, prompt, out, P), by_definition(logits, prompt, out, P))
        assert torch.equal(penalize(logits, prompt, out, SamplingParams(0.8)), logits)  # off: unchanged
    state = PenaltyState(6, V, "cpu")
    slots = [4, 0, 2, 5]
    for s, (_, prompt, out) in zip(slots, rows):
        state.admit(s, prompt, out[:-1])
        if out:
            state.count(torch.tensor([s]), torch.tensor([out[-1]]))  # a decode step's token, counted on the device
    params = [P, SamplingParams(0.0), P, SamplingParams(0.5, presence_penalty=2.0, logit_bias=((1, 4.0),))]
    pen = [torch.tensor([getattr(p, k) for p in params]) for k in ("presence_penalty", "frequency_penalty",
                                                                     "repetition_penalty")]
    bias = torch.zeros(len(params), V)
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            bias[i, t] += b
    got = state.apply(torch.stack([r[0] for r in rows]), torch.tensor(slots), *pen, bias)
    for i, (p, (logits, prompt, out)) in enumerate(zip(params, rows)):
        torch.testing.assert_close(got[i], penalize(logits, prompt, out, p))


@pytest.fixture(scope="module")
def model():
    return randomize_(build_model(ModelConfig.preset("v4-tiny-a"), dtype=torch.float32), seed=3).eval()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_session_tokens_follow_the_host_rule_pipelined_or_not(model, temperature):
    """Requests with and without penalties decode together: every token is the host rule's choice from the
    logits row it was sampled from (the first from prefill, on the host; the rest from the device sampler),
    and pipelined decoding gives the same tokens."""
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(2, V, (n,), generator=g).tolist() for n in (7, 12, 3)]
    kw = dict(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.3, logit_bias=((5, 1.5), (9, -2.0)))
    p = SamplingParams(temperature, **kw)
    sess = eager_session(model, 8, False)
    tokens, logits = serve(sess, ps, max_new=24, temperature=temperature, **kw)  # one step at a time, rows recorded
    for i, (prompt, toks, rows) in enumerate(zip(ps, tokens, logits)):
        for j, row in enumerate(rows):
            want = sample_at(penalize(row, prompt, toks[:j], p), p, 5 + i, len(prompt) + j - 1)
            assert toks[j] == want, (i, j)
    with torch.no_grad():
        piped = [r.tokens for r in sess.generate(ps, max_new_tokens=24, temperature=temperature, seed=5, **kw)]
    assert piped == tokens
    plain = [r.tokens for r in sess.generate(ps, max_new_tokens=24, temperature=temperature, seed=5)]
    assert plain != tokens  # the penalties changed something


def test_penalties_are_refused_with_mtp_and_out_of_range(model):
    sess = eager_session(model, 8, False, mtp_k=2)
    with pytest.raises(ValueError, match="frequency_penalty: penalties and logit biases are applied by plain decoding only"):
        sess.generate([[3, 4, 5]], max_new_tokens=4, mtp=2, frequency_penalty=0.5)
    with pytest.raises(ValueError, match="repetition_penalty: must be in"):
        sess.generate([[3, 4, 5]], max_new_tokens=4, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="presence_penalty: must be in"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias: penalties and logit biases are applied by plain decoding"):
        sess.generate([[3, 4, 5]], max_new_tokens=4, mtp=2, logit_bias=((4, 1.0),))
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[99999\] are outside the vocabulary"):
        sess.generate([[3, 4, 5]], max_new_tokens=4, logit_bias=((99999, 1.0),))
    with pytest.raises(ValueError, match="logit_bias: token ids >= 0 and biases in"):
        SamplingParams(logit_bias=((1, 101.0),))


def test_a_server_running_mtp_refuses_penalties_naming_the_field():
    """runtime/serve.py `_sampling`: 400 with the field as `param` while the server runs k >= 1; none set: served."""
    from types import SimpleNamespace

    from dsv4c.runtime.serve import APIError, CompletionRequest, _sampling

    st = SimpleNamespace(sess=SimpleNamespace(max_tokens=64, config=SimpleNamespace(vocab_size=100)), mtp={"k": 2})
    for extra, field in (({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"3": 1.0}}, "logit_bias"),
                         ({"repetition_penalty": 1.2}, "repetition_penalty")):
        with pytest.raises(APIError, match="applied by plain decoding only") as e:
            _sampling(st, CompletionRequest(model="m", prompt="x", max_tokens=4, **extra), [1, 2], False)
        assert (e.value.status, e.value.param) == (400, field)
    assert len(_sampling(st, CompletionRequest(model="m", prompt="x", max_tokens=4, n=2), [1, 2], False)) == 2
