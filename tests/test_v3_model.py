"""The V3 / V3.2 eager reference model (dsv4c/model/v3.py) against HF transformers and the spec.

All on CPU in fp32 with the tiny presets (deepseek_v3_mla.md §9). Every dsv4c tensor is randomised
(std 0.3, random router bias) and copied into HF by name with a strict no-leftover check.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oracle import hf_config, hf_v3_model, randomize_v3_, to_hf_state_dict
from dsv4c.config import ModelConfig
from dsv4c.model.common import rope_interleaved
from dsv4c.model.moe import moe_experts_loop
from dsv4c.model.v3 import DeepseekV3Model, LayerCache, MoE, softmax_scale

PRESETS = ["v3-tiny", "v32-tiny"]
TOL = 1e-4  # max |a - b| / max |b|


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def ids_for(cfg: ModelConfig, B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


class Pair:
    def __init__(self, name: str):
        self.cfg = ModelConfig.preset(name)
        self.model = DeepseekV3Model(self.cfg).eval()
        randomize_v3_(self.model, seed=0)
        self.hf = hf_v3_model(self.model)


@pytest.fixture(scope="module", params=PRESETS)
def pair(request) -> Pair:
    return Pair(request.param)


# ------------------------------------------------------------------------------------------------
# names and layout
# ------------------------------------------------------------------------------------------------
def test_state_dict_names(pair: Pair):
    cfg, sd = pair.cfg, pair.model.state_dict()
    n = cfg.num_hidden_layers
    mtp = {k for k in sd if k.startswith(f"model.layers.{n}.")}
    # main model: HF's names, experts stacked (checked against HF's own state dict in hf_v3_model)
    assert set(to_hf_state_dict(sd, skip_prefix=f"model.layers.{n}.")) == set(pair.hf.state_dict())
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert sd["model.layers.1.mlp.experts.gate_proj"].shape == (E, I, D)
    assert sd["model.layers.1.mlp.experts.up_proj"].shape == (E, I, D)
    assert sd["model.layers.1.mlp.experts.down_proj"].shape == (E, D, I)
    # MTP: own norms/projection + a full MoE layer, no embedding or head copy
    p = f"model.layers.{n}."
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "mlp.gate.weight",
              "mlp.gate.e_score_correction_bias", "mlp.experts.gate_proj", "mlp.shared_experts.down_proj.weight",
              "self_attn.kv_b_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
        assert p + k in mtp, k
    assert sd[p + "eh_proj.weight"].shape == (D, 2 * D)
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in mtp)
    assert (p + "self_attn.indexer.k_norm.bias" in mtp) == cfg.has_dsa_indexer


def test_bf16_keeps_fp32_tensors_and_runs(pair: Pair):
    """Under `.to(bfloat16)` the router bias and the rotary table stay fp32; decode runs in bf16."""
    m16 = DeepseekV3Model(pair.cfg).eval()
    m16.load_state_dict(pair.model.state_dict())
    m16.to(torch.bfloat16)
    gate = m16.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32 and gate.weight.dtype == torch.bfloat16
    assert m16.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(m16.rotary.inv_freq, pair.model.rotary.inv_freq)
    ids = ids_for(pair.cfg, 2, 10, seed=9)
    cache, mtp_cache = m16.new_cache(2), m16.new_mtp_cache(2)
    with torch.no_grad():
        logits, h = m16.forward_with_hidden(ids[:, :8], cache)
        step = m16(ids[:, 8:9], cache)
        mtp_logits, z = m16.mtp_forward(h, ids[:, 1:9], mtp_cache)
    assert logits.dtype == step.dtype == mtp_logits.dtype == z.dtype == torch.bfloat16
    assert cache.layers[0].latent.dtype == torch.bfloat16 and cache.length == 9 and mtp_cache.length == 8
    assert torch.isfinite(logits).all() and torch.isfinite(step).all() and torch.isfinite(mtp_logits).all()


def test_rope_and_scale_match_hf(pair: Pair):
    """Same YaRN frequencies and softmax scale as HF; HF's interleaved rope = ours, de-interleaved."""
    hf_rot = pair.hf.model.rotary_emb
    torch.testing.assert_close(pair.model.rotary.inv_freq, hf_rot.inv_freq, rtol=1e-6, atol=0)
    assert pair.model.rope_factor == pytest.approx(hf_rot.attention_scaling)
    assert softmax_scale(pair.cfg) == pytest.approx(pair.hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert softmax_scale(ModelConfig.preset("v3")) == pytest.approx(0.13523378, rel=1e-7)  # spec §3

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    r = pair.cfg.qk_rope_head_dim
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 7, r, generator=g), torch.randn(1, 1, 7, r, generator=g)
    pos = torch.arange(100, 107)[None]
    cos_hf, sin_hf = hf_rot(q, pos)
    q_hf, k_hf = apply_rotary_pos_emb_interleave(q, k, cos_hf, sin_hf)
    cos, sin = pair.model.rotary(pos[0])
    deinterleave = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
    torch.testing.assert_close(rope_interleaved(q, cos, sin)[..., deinterleave], q_hf, rtol=0, atol=1e-5)
    torch.testing.assert_close(rope_interleaved(k, cos, sin)[..., deinterleave], k_hf, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# (a) prefill
# ------------------------------------------------------------------------------------------------
def test_prefill_matches_hf(pair: Pair):
    ids = ids_for(pair.cfg, 2, 24, seed=1)  # T = 24 > index_topk = 6: the DSA selection is active
    with torch.no_grad():
        logits, h = pair.model.forward_with_hidden(ids)
        hf_out = pair.hf(ids, output_hidden_states=True)
    assert logits.shape == (2, 24, pair.cfg.vocab_size) and h.shape == (2, 24, pair.cfg.hidden_size)
    assert rel_err(logits, hf_out.logits) <= TOL
    assert rel_err(h, pair.hf.model(ids).last_hidden_state) <= TOL  # h is after model.norm


def test_dsa_selection_is_active():
    """On V3.2 with T > index_topk the selection changes the logits (so test (a) exercises it)."""
    p = Pair("v32-tiny")
    dense = DeepseekV3Model(p.cfg.replace(index_topk=10_000)).eval()
    dense.load_state_dict(p.model.state_dict())
    ids = ids_for(p.cfg, 2, 24, seed=1)
    with torch.no_grad():
        sparse_l, dense_l = p.model(ids), dense(ids)
        assert rel_err(sparse_l[:, : p.cfg.index_topk], dense_l[:, : p.cfg.index_topk]) <= TOL  # t+1 <= topk
        assert rel_err(sparse_l, dense_l) > 1e-2


def test_cache_layout_matches_hf(pair: Pair):
    """c_KV equals HF's cached latent; our k_pe is interleaved, HF's the de-interleaved permutation."""
    ids = ids_for(pair.cfg, 2, 9, seed=2)
    cache = pair.model.new_cache(2)
    with torch.no_grad():
        pair.model(ids, cache)
        hf_cache = pair.hf(ids, use_cache=True).cache
    r = pair.cfg.qk_rope_head_dim
    deinterleave = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
    assert cache.length == 9
    assert len(cache.layers) == pair.cfg.num_hidden_layers
    for layer, lc in enumerate(cache.layers):
        hl = hf_cache.layers[layer]
        torch.testing.assert_close(lc.latent[:, :9], hl.keys[:, 0], rtol=0, atol=1e-5)
        torch.testing.assert_close(lc.kpe[:, :9, deinterleave], hl.values[:, 0], rtol=0, atol=1e-5)
        if pair.cfg.has_dsa_indexer:
            torch.testing.assert_close(lc.index_keys[:, :9], hl.indexer_keys, rtol=0, atol=1e-5)
        else:
            assert lc.index_keys is None and set(lc.tensors()) == {"latent", "kpe"}
        assert all((t[:, 9:] == 0).all() for t in lc.tensors().values())  # rows past the positions: untouched


# ------------------------------------------------------------------------------------------------
# (b) greedy decode
# ------------------------------------------------------------------------------------------------
def test_greedy_decode_matches_hf(pair: Pair):
    B, P, N = 2, 8, 16
    prompt = ids_for(pair.cfg, B, P, seed=3)
    with torch.no_grad():
        # explicit mask: otherwise HF infers one from pad_token_id and masks prompt tokens equal to it
        out = pair.hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N, min_new_tokens=N,
                               do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        cache = pair.model.new_cache(B)
        step_logits = pair.model(prompt, cache)[:, -1]
        tokens = []
        for i in range(N):
            assert rel_err(step_logits, out.logits[i]) <= TOL, f"step {i}"
            tok = step_logits.argmax(-1)
            tokens.append(tok)
            step_logits = pair.model(tok[:, None], cache)[:, -1]
    assert torch.equal(torch.stack(tokens, 1), out.sequences[:, P:])
    assert cache.length == P + N


# ------------------------------------------------------------------------------------------------
# (c) incremental = one prefill
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", [1, 7, 13])
def test_decode_equals_prefill(pair: Pair, prefix: int):
    T = 20
    ids = ids_for(pair.cfg, 2, T, seed=4)
    with torch.no_grad():
        full = pair.model(ids)
        cache = pair.model.new_cache(2)
        parts = [pair.model(ids[:, :prefix], cache)]
        for t in range(prefix, T):
            parts.append(pair.model(ids[:, t : t + 1], cache))
    assert cache.length == T and cache.pos.tolist() == [T, T]
    assert rel_err(torch.cat(parts, 1), full) <= TOL


@pytest.mark.parametrize("chunk", [3, 5])
def test_chunked_extend_equals_prefill(pair: Pair, chunk: int):
    T, prefix = 23, 4
    ids = ids_for(pair.cfg, 2, T, seed=5)
    with torch.no_grad():
        full = pair.model(ids)
        cache = pair.model.new_cache(2)
        parts = [pair.model(ids[:, :prefix], cache)]
        for t in range(prefix, T, chunk):
            parts.append(pair.model(ids[:, t : t + chunk], cache))
    assert cache.length == T
    assert rel_err(torch.cat(parts, 1), full) <= TOL


# ------------------------------------------------------------------------------------------------
# (d) MTP against a plain transcription of spec §8
# ------------------------------------------------------------------------------------------------
def _hf_mtp_layer(pair: Pair) -> torch.nn.Module:
    """HF's decoder layer (MoE kind) holding the MTP layer's self_attn/mlp/norm tensors: the oracle for
    §8.4's "full MoE decoder layer"."""
    cfg, n = pair.cfg, pair.cfg.num_hidden_layers
    cls = type(pair.hf.model.layers[n - 1])  # layer n-1 >= first_k_dense_replace: an MoE layer
    layer = cls(hf_config(cfg), layer_idx=n - 1).float().eval()
    assert type(layer.mlp).__name__.endswith("MoE")
    prefix = f"model.layers.{n}."
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
    sd = {k[len(prefix):]: v for k, v in pair.model.state_dict().items()
          if k.startswith(prefix) and not k[len(prefix):].startswith(own)}
    layer.load_state_dict(to_hf_state_dict(sd), strict=True)
    return layer


def _mtp_reference(pair: Pair, layer: torch.nn.Module, h: torch.Tensor, next_ids: torch.Tensor, zero_pos0: bool):
    """§8 for inputs at positions 0..T-1, written from the state dict: e = enorm(embed(x_{i+1})) (zeroed
    at position 0 if asked), g = hnorm(h_i), y = eh_proj([e; g]), z = decoder layer (causal),
    logits = lm_head(shared_head.norm(z))."""
    cfg, sd = pair.cfg, pair.model.state_dict()
    p = f"model.layers.{cfg.num_hidden_layers}."

    def rmsnorm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    T = h.shape[1]
    emb = F.embedding(next_ids, sd["model.embed_tokens.weight"])
    if zero_pos0:
        emb = emb.clone()
        emb[:, 0] = 0
    e, g = rmsnorm(emb, sd[p + "enorm.weight"]), rmsnorm(h, sd[p + "hnorm.weight"])
    y = torch.cat((e, g), -1) @ sd[p + "eh_proj.weight"].T  # embedding half first
    pos = torch.arange(T)[None]
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    z = layer(y, attention_mask=causal, position_ids=pos, position_embeddings=pair.hf.model.rotary_emb(y, pos))
    logits = rmsnorm(z, sd[p + "shared_head.norm.weight"]) @ sd["lm_head.weight"].T
    return logits, z


@pytest.mark.parametrize("zero_pos0", [True, False])
def test_mtp_matches_transcription(pair: Pair, zero_pos0: bool):
    cfg = pair.cfg.replace(mtp_zero_embed_at_pos0=zero_pos0)
    model = DeepseekV3Model(cfg).eval()
    model.load_state_dict(pair.model.state_dict())
    layer = _hf_mtp_layer(pair)
    B, P = 2, 12  # P > index_topk on V3.2
    ids = ids_for(cfg, B, P + 1, seed=6)  # x_0 .. x_P
    with torch.no_grad():
        _, h = model.forward_with_hidden(ids[:, :P])  # h_0 .. h_{P-1}, post-norm
        mtp_cache = model.new_mtp_cache(B)
        # step 1 in two chunks (positions 0..4, 5..P-1): inputs (h_i, x_{i+1})
        l_a, z_a = model.mtp_forward(h[:, :5], ids[:, 1:6], mtp_cache)
        l_b, z_b = model.mtp_forward(h[:, 5:], ids[:, 6 : P + 1], mtp_cache)
        l1, z1 = torch.cat((l_a, l_b), 1), torch.cat((z_a, z_b), 1)
        ref_l1, ref_z1 = _mtp_reference(pair, layer, h, ids[:, 1 : P + 1], zero_pos0)
        assert rel_err(l1, ref_l1) <= TOL and rel_err(z1, ref_z1) <= TOL
        # the flag matters: the other setting gives different numbers
        other_l1, _ = _mtp_reference(pair, layer, h, ids[:, 1 : P + 1], not zero_pos0)
        assert rel_err(l1, other_l1) > 1e-3

        # step 2 (recursion, k = 2): h <- z_{P-1}, token <- the draft, at position P
        draft = l1[:, -1].argmax(-1)
        l2, z2 = model.mtp_forward(z1[:, -1:], draft[:, None], mtp_cache)
        ref_l2, ref_z2 = _mtp_reference(pair, layer, torch.cat((h, ref_z1[:, -1:]), 1),
                                        torch.cat((ids[:, 1 : P + 1], draft[:, None]), 1), zero_pos0)
        assert rel_err(l2, ref_l2[:, -1:]) <= TOL and rel_err(z2, ref_z2[:, -1:]) <= TOL
    assert mtp_cache.length == P + 1 and l2.shape == (B, 1, cfg.vocab_size) and z2.shape == (B, 1, cfg.hidden_size)


# ------------------------------------------------------------------------------------------------
# (e) MoE: custom op vs loop reference; module vs HF's
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_moe_custom_op_matches_loop(limit: float):
    g = torch.Generator().manual_seed(7)
    T, D, E, K, I = 11, 16, 6, 3, 8
    x = torch.randn(T, D, generator=g)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[0] = torch.tensor([2, 2, 5])  # a repeated expert adds twice
    w = torch.rand(T, K, generator=g)
    w1, w3 = torch.randn(E, I, D, generator=g) * 0.3, torch.randn(E, I, D, generator=g) * 0.3
    w2 = torch.randn(E, D, I, generator=g) * 0.3
    got = torch.ops.dsv4c.moe_experts(x, idx, w, w1, w3, w2, limit)
    ref = moe_experts_loop(x, idx, w, w1, w3, w2, limit)
    assert rel_err(got, ref) <= 1e-5


def test_moe_layer_matches_hf(pair: Pair):
    ours, theirs = pair.model.model.layers[1].mlp, pair.hf.model.layers[1].mlp
    assert isinstance(ours, MoE)
    x = torch.randn(2, 9, pair.cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        idx, _ = ours.gate(x.reshape(-1, x.shape[-1]))
        _, _, hf_idx = theirs.gate(x)
        assert torch.equal(idx.sort(-1).values, hf_idx.sort(-1).values)
        assert rel_err(ours(x), theirs(x)) <= TOL
        # the correction bias changes the selection (routing is non-trivial)
        no_bias = ours.gate.e_score_correction_bias.clone().zero_()
        saved = ours.gate.e_score_correction_bias.clone()
        ours.gate.e_score_correction_bias.copy_(no_bias)
        idx0, _ = ours.gate(x.reshape(-1, x.shape[-1]))
        ours.gate.e_score_correction_bias.copy_(saved)
    assert not torch.equal(idx0.sort(-1).values, idx.sort(-1).values)


def test_moe_exports():
    """Routing is export-friendly: one graph, the experts as a single dsv4c.moe_experts node."""
    p = Pair("v3-tiny")
    moe = p.model.model.layers[1].mlp
    ep = torch.export.export(moe, (torch.randn(1, 5, p.cfg.hidden_size),))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("moe_experts" in t for t in targets) == 1


# ------------------------------------------------------------------------------------------------
# (f) static caches: the custom ops, ragged batches with padding, export
# ------------------------------------------------------------------------------------------------
def test_cache_ops_reference():
    """mla/dsa_cache_update write exactly the real rows at their positions; dsa_topk picks the
    top-min(topk, p+1) causal keys of the fp32 score (-1 elsewhere)."""
    g = torch.Generator().manual_seed(10)
    B, T, L, c, r = 2, 4, 9, 5, 3
    slots, pos0, n_real = torch.tensor([1, 0]), torch.tensor([0, 5]), torch.tensor([4, 2])
    c_kv, k_pe = torch.randn(B, T, c, generator=g), torch.randn(B, T, r, generator=g)
    latent, kpe = torch.zeros(B, L, c), torch.zeros(B, L, r)
    torch.ops.dsv4c.mla_cache_update(c_kv, k_pe, slots, pos0, n_real, latent, kpe)  # row b -> cache slot slots[b]
    assert torch.equal(latent[1, :4], c_kv[0]) and torch.equal(kpe[0, 5:7], k_pe[1, :2])
    assert (latent[1, 4:] == 0).all() and (latent[0, :5] == 0).all() and (latent[0, 7:] == 0).all()
    keys = torch.zeros(B, L, r)
    torch.ops.dsv4c.dsa_cache_update(k_pe, slots, pos0, n_real, keys)
    assert torch.equal(keys, kpe)

    HI, dI, topk = 3, 4, 3
    q, w = torch.randn(B, T, HI, dI, generator=g), torch.randn(B, T, HI, generator=g)
    keys = torch.randn(B, L, dI, generator=g)
    idx = torch.ops.dsv4c.dsa_topk(q, w, keys, pos0, topk)
    assert idx.shape == (B, T, topk) and idx.dtype == torch.int64
    for b in range(B):
        for t in range(T):
            p = int(pos0[b]) + t
            score = [sum(float(w[b, t, h]) * max(0.0, float(q[b, t, h] @ keys[b, s]) / dI**0.5) for h in range(HI))
                     for s in range(p + 1)]
            want = sorted(range(p + 1), key=lambda s: -score[s])[:topk]
            got = idx[b, t].tolist()
            assert sorted(s for s in got if s >= 0) == sorted(want) and got.count(-1) == topk - len(want), (b, t)


def test_cache_checks(pair: Pair):
    model, V = pair.model, pair.cfg.vocab_size
    cache = model.new_cache(2, max_len=8)
    assert cache.max_len == 8 and cache.layers[0].latent.shape == (2, 8, pair.cfg.kv_lora_rank)
    with pytest.raises(ValueError, match="batch"):
        model(torch.zeros(3, 2, dtype=torch.int64), cache)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(2, 9, dtype=torch.int64), cache)
    assert cache.pos.tolist() == [0, 0]  # a refused chunk changes nothing
    with torch.no_grad():
        model.forward_with_hidden(torch.full((2, 3), V - 1), cache, n_real=torch.tensor([3, 1]))
    assert cache.pos.tolist() == [3, 1]
    with pytest.raises(ValueError, match="different positions"):
        cache.length


@torch.no_grad()
def test_ragged_batch_with_padding_equals_separate_sequences(pair: Pair):
    """Sequences at different positions share a batch; padded rows (n_real) never touch real state."""
    model, V = pair.model, pair.cfg.vocab_size
    g = torch.Generator().manual_seed(11)
    lens, steps, L = [5, 11], 4, 24  # 11 > index_topk: the DSA selection is active (V3.2)
    seqs = [torch.randint(0, V, (1, n + steps), generator=g) for n in lens]
    alone = []
    for s, n in zip(seqs, lens):
        c = model.new_cache(1, max_len=L)
        alone.append(torch.cat([model(s[:, :n], c)] + [model(s[:, n + i : n + i + 1], c) for i in range(steps)], 1))
    cache = model.new_cache(2, max_len=L)
    P = max(lens)
    prompt = torch.stack([F.pad(s[0, :n], (0, P - n), value=V - 1) for s, n in zip(seqs, lens)])
    first, _ = model.forward_with_hidden(prompt, cache, n_real=torch.tensor(lens))
    assert cache.pos.tolist() == lens
    for lc in cache.layers:  # the padded rows of sequence 0 wrote nothing
        assert all((t[0, lens[0]:] == 0).all() for t in lc.tensors().values())
        for t in lc.tensors().values():  # rows past a position are never read (stale rows after a rollback)
            for b, n in enumerate(lens):
                t[b, n:] = torch.randn(t[b, n:].shape, generator=g)
    outs = [model(torch.stack([s[0, n + i : n + i + 1] for s, n in zip(seqs, lens)]), cache) for i in range(steps)]
    assert cache.pos.tolist() == [n + steps for n in lens]
    for b, n in enumerate(lens):
        got = torch.cat([first[b : b + 1, :n]] + [o[b : b + 1] for o in outs], 1)
        assert rel_err(got, alone[b]) <= TOL


@torch.no_grad()
def test_mtp_ragged_batch_equals_separate_sequences(pair: Pair):
    """MTP with per-sequence positions: sequence 0 starts (position 0, embedding zeroed) while sequence 1
    sits at position 5; rows with n_real = 0 write nothing."""
    model, D, V = pair.model, pair.cfg.hidden_size, pair.cfg.vocab_size
    g = torch.Generator().manual_seed(12)
    h, ids = torch.randn(2, 8, D, generator=g), torch.randint(0, V, (2, 8), generator=g)
    alone = [model.mtp_forward(h[b : b + 1], ids[b : b + 1], model.new_mtp_cache(1, max_len=8))[0] for b in range(2)]
    cache = model.new_mtp_cache(2, max_len=8)
    # chunk 1: sequence 0 all padding, sequence 1 rows 0..4
    l1, _ = model.mtp_forward(h[:, :5], ids[:, :5], cache, n_real=torch.tensor([0, 5]))
    # chunk 2: sequence 0 rows 0..2, sequence 1 rows 5..7
    l2, _ = model.mtp_forward(torch.stack((h[0, :3], h[1, 5:])), torch.stack((ids[0, :3], ids[1, 5:])), cache)
    # chunk 3: sequence 0 rows 3..7, sequence 1 padding
    l3, _ = model.mtp_forward(h[:, 3:], ids[:, 3:], cache, n_real=torch.tensor([5, 0]))
    assert cache.pos.tolist() == [8, 8]
    assert rel_err(torch.cat((l2[0], l3[0])), alone[0][0]) <= TOL
    assert rel_err(torch.cat((l1[1], l2[1])), alone[1][0]) <= TOL


class _Step(torch.nn.Module):
    """`model.step` with the caches as a list of dicts of tensors (what export flattens)."""

    def __init__(self, model: DeepseekV3Model):
        super().__init__()
        self.model = model

    def forward(self, ids, slots, pos0, n_real, caches: list[dict[str, torch.Tensor]]):
        return self.model.step(ids, slots, pos0, n_real, [LayerCache(**d) for d in caches])


@torch.no_grad()
def test_step_exports_with_caches_as_inputs(pair: Pair):
    """torch.export traces `step` with a dynamic chunk length: the cache writes are custom ops on the
    cache inputs, the naive attention reads the whole latent cache through kv_b_proj in plain ATen, and
    the exported module reproduces eager (ragged positions, prefill then decode)."""
    model, cfg = pair.model, pair.cfg
    n_layers, L = cfg.num_hidden_layers, 32

    def fresh() -> list[dict[str, torch.Tensor]]:
        return [lc.tensors() for lc in model.new_cache(2, max_len=L).layers]

    caches = fresh()
    ids = ids_for(cfg, 2, 5, seed=13)
    T = torch.export.Dim("T", min=1, max=64)
    slots = torch.arange(2)
    ep = torch.export.export(_Step(model), (ids, slots, torch.zeros(2, dtype=torch.int64), torch.full((2,), 5), caches),
                             strict=False,
                             dynamic_shapes=({1: T}, None, None, None, [{k: None for k in d} for d in caches]))

    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    count = lambda op: sum(n.target == op for n in calls)  # noqa: E731
    ops = torch.ops.dsv4c
    assert count(ops.mla_cache_update.default) == n_layers
    assert count(ops.dsa_cache_update.default) == count(ops.dsa_topk.default) == (n_layers if cfg.has_dsa_indexer else 0)
    sig = ep.graph_signature
    cache_inputs = sig.user_inputs[4:]  # ids, slots, pos0, n_real, then each layer's cache dict flattened
    assert len(cache_inputs) == sum(len(d) for d in caches)
    for i in range(n_layers):  # kv_b_proj applied to the whole latent cache input, after its update
        latent = cache_inputs[sum(len(d) for d in caches[:i])]
        weight = f"model.model.layers.{i}.self_attn.kv_b_proj.weight"
        lin = [n for n in calls if n.target == torch.ops.aten.linear.default
               and n.args[0].target == torch.ops.aten.index.Tensor and n.args[0].args[0].name == latent  # latent[slots]
               and sig.inputs_to_parameters.get(n.args[1].name) == weight]
        upd = [n for n in calls if n.target == ops.mla_cache_update.default and n.args[5].name == latent]
        assert len(lin) == len(upd) == 1, i
        assert calls.index(upd[0]) < calls.index(lin[0])

    run = ep.module()
    got_c, want_c = fresh(), fresh()
    chunks = [(ids_for(cfg, 2, 9, seed=14), torch.tensor([0, 0]), torch.tensor([9, 6])),  # ragged prefill
              (ids_for(cfg, 2, 1, seed=15), torch.tensor([9, 6]), torch.tensor([1, 1]))]   # decode, T = 1
    for x, pos0, n_real in chunks:
        got, _ = run(x, slots, pos0, n_real, got_c)
        want, _ = model.step(x, slots, pos0, n_real, [LayerCache(**d) for d in want_c])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_c, want_c):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6, msg=k)
