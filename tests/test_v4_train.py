"""The differentiable training forward (dsv4c.model.v4_train) against the cached reference model."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model
from dsv4c.model.v4_train import lm_losses, params_without_grad, train_forward, train_mtp_forward

# (preset, length, batch): lengths that close several groups of every compress ratio (C: two HCA-128 entries).
CONFIGS = [("v4-tiny-a", 40, 2), ("v4-tiny-b", 72, 2), ("v4-tiny-c", 300, 1)]
IDS = [c[0] for c in CONFIGS]
RTOL = 1e-5  # max |error| / max |reference|, fp32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _setup(name: str, T: int, B: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    cfg = ModelConfig.preset(name)
    model = build_model(cfg, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    return model, ids


def _expected_without_grad(cfg: ModelConfig, with_mtp: bool = True) -> set[str]:
    """Written from the config: each CSA layer's indexer (reached only through its integer top-k) and
    the bias of each non-hash router (selection only), MTP block included; without the MTP loss the
    whole MTP block."""
    names = set()
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_ratio(i) == 4:
            p = f"layers.{i}.attn.indexer."
            names |= {p + "wq_b.weight", p + "weights_proj.weight", p + "compressor.ape",
                      p + "compressor.wkv.weight", p + "compressor.wgate.weight", p + "compressor.norm.weight"}
        if not cfg.is_hash_layer(i):
            names.add(f"layers.{i}.ffn.gate.bias")
    names.add("mtp.0.ffn.gate.bias")
    return names


def _without_grad(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.ne(0).any())}


@pytest.mark.parametrize("name,T,B", CONFIGS, ids=IDS)
def test_train_forward_equals_cached_forward(name, T, B):
    model, ids = _setup(name, T, B)
    cfg = model.config
    assert all(T // m >= 2 for m in cfg.compress_ratios if m)  # every compressed branch has entries
    with torch.no_grad():
        want, want_streams = model.forward_with_streams(ids)
    got, streams = train_forward(model, ids)
    assert got.dtype == torch.float32 and got.shape == (B, T, cfg.vocab_size)
    assert streams.shape == (B, T, cfg.hc_mult, cfg.hidden_size) and got.requires_grad
    assert rel_err(got, want) <= RTOL
    assert rel_err(streams, want_streams) <= RTOL


@pytest.mark.parametrize("name,T,B", CONFIGS, ids=IDS)
def test_train_mtp_forward_equals_mtp_forward(name, T, B):
    model, ids = _setup(name, T + 1, B, seed=1)
    with torch.no_grad():
        _, streams = model.forward_with_streams(ids[:, :-1])
        want, want_Z = model.mtp_forward(streams, ids[:, 1:], model.new_mtp_cache(B, max_len=T))
    got, Z = train_mtp_forward(model, streams, ids[:, 1:])
    assert rel_err(got, want) <= RTOL
    assert rel_err(Z, want_Z) <= RTOL


@pytest.mark.parametrize("name,T,B", CONFIGS, ids=IDS)
def test_every_parameter_but_the_selection_ones_gets_a_gradient(name, T, B):
    model, ids = _setup(name, T, B, seed=2)
    main, mtp = lm_losses(model, ids)
    (main + 0.3 * mtp).backward()
    expected = _expected_without_grad(model.config)
    assert _without_grad(model) == expected
    assert params_without_grad(model) == expected
    for n, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), n
    # hash routing reads tid2eid, a buffer: nothing to train there
    assert "layers.0.ffn.gate.tid2eid" in dict(model.named_buffers())
    assert not any(n.endswith("tid2eid") for n, _ in model.named_parameters())


def test_main_loss_alone_leaves_the_mtp_block_untouched():
    model, ids = _setup("v4-tiny-a", 40, 2, seed=3)
    logits, _ = train_forward(model, ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    mtp = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    assert _without_grad(model) == _expected_without_grad(model.config) | mtp
    assert params_without_grad(model, with_mtp=False) == _expected_without_grad(model.config) | mtp


def test_lm_losses_use_the_documented_targets():
    model, ids = _setup("v4-tiny-a", 24, 2, seed=4)
    main, mtp = lm_losses(model, ids)
    with torch.no_grad():
        logits, streams = model.forward_with_streams(ids)
        draft, _ = model.mtp_forward(streams[:, :-2], ids[:, 1:-1], model.new_mtp_cache(2, max_len=22))
    ce = torch.nn.functional.cross_entropy
    torch.testing.assert_close(main, ce(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mtp, ce(draft.flatten(0, 1), ids[:, 2:].flatten()), rtol=1e-5, atol=1e-5)


def test_adam_steps_reduce_the_loss():
    model, ids = _setup("v4-tiny-a", 32, 4, seed=5)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        main, mtp = lm_losses(model, ids)
        loss = main + 0.3 * mtp
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v, losses))  # no NaN
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name,T,B", CONFIGS[:2], ids=IDS[:2])
def test_bf16_weights_match_the_bf16_reference(name, T, B):
    """Activation-dtype casts sit where the reference has them (the random models are chaotic in bf16,
    so any misplaced rounding shows)."""
    model, ids = _setup(name, T, B, dtype=torch.bfloat16, seed=6)
    with torch.no_grad():
        want, want_streams = model.forward_with_streams(ids)
        got, streams = train_forward(model, ids)
    assert streams.dtype == torch.bfloat16
    assert rel_err(got, want) <= 1e-2 and rel_err(streams, want_streams) <= 1e-2


def test_autocast_bf16_backward_is_finite():
    model, ids = _setup("v4-tiny-b", 72, 2, seed=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        main, mtp = lm_losses(model, ids)
    (main + mtp).backward()
    assert torch.isfinite(main) and torch.isfinite(mtp)
    assert _without_grad(model) == _expected_without_grad(model.config)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
