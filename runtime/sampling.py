"""Token sampling: temperature, then top-k and top-p, then min-p, then renormalisation (speculative_decoding.md
§3.2 defines acceptance on exactly this processed distribution). min-p keeps the tokens whose probability is
at least min_p times the most likely one's; that ratio does not change under renormalisation, so it is the
same test on the temperature's distribution, restricted to what top-k and top-p kept.

The RNG contract of plain decoding (`Session`, k = 0): the token x_{n+1} that a request samples from the
logits of position n is `sample_rows(logits, rp, u)` with u = `counter_uniforms(seed, n, 1)[:, 0]`, a pure
function of the request's seed and the position (`sample_at` on the host, `DecodeSampler` on the device,
one table of uniforms every `DecodeSampler.TABLE` steps). So a seeded request gets the same tokens
whichever batch it shares, whether its steps are pipelined or read one at a time. (Before, plain
decoding drew with `torch.multinomial` from a per-request CPU generator: other tokens for the same seed.)

Penalties (plain decoding only) change the logits before any of that, greedy rows included, in this order:
OpenAI's logit_bias (added to the listed tokens' logits), repetition (a token of the prompt or the output so
far: a positive logit divided by r, a negative one multiplied by r; CTRL's rule, as Hugging Face and vLLM have
it), then frequency and presence (OpenAI's: minus f x the token's count in the output so far, minus p when that
count is > 0). `penalize` is the rule on the host;
`PenaltyState` keeps every cache slot's counts on the device so `DecodeSampler` applies it without the host."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    presence_penalty: float = 0.0  # -2..2 (module docstring)
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_p: float = 0.0  # 0..1; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a penalty (plain decoding)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty: must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        bad = [(t, b) for t, b in self.logit_bias if t < 0 or not -100 <= b <= 100]
        if bad:
            raise ValueError(f"logit_bias: token ids >= 0 and biases in [-100, 100], got {bad[:3]}")

    def penalty_fields(self) -> list[str]:
        """The penalties (and logit_bias) set, by field name: what only plain decoding applies."""
        return [k for k, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                                 ("logit_bias", ())) if getattr(self, k) != off]

    @property
    def penalized(self) -> bool:
        """Penalties or a logit bias: the logits change with the request's tokens or its own table."""
        return bool(self.penalty_fields())

    def plain_only(self, hint: str) -> str:
        """The error for penalties asked of MTP speculative decoding, naming the first field set."""
        return (f"{self.penalty_fields()[0]}: penalties and logit biases are applied by plain decoding only, not in "
                f"MTP speculative decoding ({hint})")


def penalize(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """The penalties' rule (module docstring) on the host: logits [V] of the position after `out` -> fp32 [V]."""
    x = logits.float().clone()
    if not p.penalized:
        return x
    V = x.shape[-1]
    for t, b in p.logit_bias:
        x[t] += b
    counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V).float()
    seen = counts > 0
    seen[torch.tensor(prompt, dtype=torch.int64)] = True
    return _penalty_rule(x, counts, seen, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)


def _penalty_rule(x: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence, frequency,
                  repetition) -> torch.Tensor:
    """Repetition on the `seen` tokens (prompt or output), then frequency x counts and presence where counted.
    x, counts fp32 and seen bool, all [..., V]; the penalties are numbers or [..., 1] tensors."""
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0).float()


class PenaltyState:
    """Every cache slot's output-token counts and prompt tokens on the device, for the penalties of plain
    decoding (`DecodeSampler`): filled at admission (`admit`, host lists), counted by each decode step on the
    device (`count`), read as `penalize` reads its lists (`apply`). Made when the first penalized request comes."""

    def __init__(self, slots: int, V: int, device):
        self.counts = torch.zeros(slots, V, dtype=torch.int32, device=device)  # output tokens so far
        self.prompt = torch.zeros(slots, V, dtype=torch.bool, device=device)  # tokens of the prompt

    def admit(self, slot: int, prompt: list[int], out: list[int]) -> None:
        dev, V = self.counts.device, self.counts.shape[1]
        self.counts[slot] = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V).to(dev, torch.int32)
        self.prompt[slot] = False
        self.prompt[slot, torch.tensor(prompt, dtype=torch.int64).to(dev)] = True

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """tokens [B] chosen for rows in (distinct) `slots` [B]: one more of each."""
        self.counts[slots, tokens] += 1

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
              repetition: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`penalize` for rows of logits [B, V] in `slots` [B], with per-row penalties [B] (0, 0, 1: unchanged)
        and logit biases [B, V] (None: none)."""
        x = logits.float() if bias is None else logits.float() + bias
        counts = self.counts[slots].float()
        seen = (counts > 0) | self.prompt[slots]
        return _penalty_rule(x, counts, seen, presence[:, None], frequency[:, None], repetition[:, None])


def processed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution actually sampled from (fp32). Greedy: one-hot argmax."""
    logits = logits.float()
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k:
        kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    if p.min_p:
        probs = _min_p(probs, p.min_p)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from logits [V]."""
    if p.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(processed_probs(logits, p), 1, generator=gen))


# ------------------------------------------------------------------------------------------------
# batched, on the device (the pipelined MTP rounds, runtime/speculative.py)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as device tensors [B], plus the host flags that decide which
    stages run (so no step reads a device value back)."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    any_top_k: bool
    any_top_p: bool
    all_greedy: bool
    any_greedy: bool = False
    divisor: torch.Tensor | None = None  # [B] fp32: the temperature, 1 on greedy rows
    min_p: torch.Tensor | None = None  # [B] fp32, 0 = off (read only when any_min_p)
    any_min_p: bool = False

    @classmethod
    def of(cls, params: list[SamplingParams], device) -> "RowParams":
        t = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        tp = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        mp = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        div = torch.where(t == 0, 1.0, t)
        return cls(_to(t, device), _to(k, device), _to(tp, device), bool(k.any()), bool((tp < 1).any()),
                   bool((t == 0).all()), bool((t == 0).any()), _to(div, device), _to(mp, device),
                   bool((mp > 0).any()))


def _to(x: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device`; to a GPU from pinned memory without waiting for queued work."""
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def one_hot_rows(idx: torch.Tensor, V: int) -> torch.Tensor:
    """idx [...] int64 -> fp32 [..., V], 1 at idx. Unlike F.one_hot it never reads a value back on the CPU
    (F.one_hot checks the range there), so a round's ops on the CPU read nothing back, as on CUDA."""
    return (torch.arange(V, device=idx.device) == idx[..., None]).float()


def processed_probs_rows(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """`processed_probs` with each row's own parameters: logits [B, ..., V] -> fp32 probabilities.
    Greedy rows are one-hot at the argmax. Same stages and tie rules as `processed_probs`."""
    logits = logits.float()
    view = (-1,) + (1,) * (logits.dim() - 1)
    greedy = (rp.temperature == 0).view(view)
    onehot = one_hot_rows(logits.argmax(-1), logits.shape[-1])
    if rp.all_greedy:
        return onehot
    x = logits / torch.where(greedy, 1.0, rp.temperature.view(view))
    if rp.any_top_k:
        V = x.shape[-1]
        top = x.sort(-1, descending=True).values
        idx = (rp.top_k.clamp(1, V) - 1).view(view).expand(*x.shape[:-1], 1)
        kth = top.gather(-1, idx)
        kth = torch.where((rp.top_k > 0).view(view), kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if rp.any_top_p:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p < rp.top_p.view(view)) | (rp.top_p >= 1).view(view)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    if rp.any_min_p:
        probs = _min_p(probs, rp.min_p.view(view))
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.where(greedy, onehot, probs)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens below min_p x the row's largest probability (min_p 0: none)."""
    return torch.where(probs >= min_p * probs.amax(-1, keepdim=True), probs, 0.0)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (murmur3's fmix32) on int64 tensors holding values < 2^32: the
    products may wrap past 2^63, and the mask keeps their low 32 bits, which wrapping preserves."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def counter_uniforms(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """Counter-based uniforms in [0, 1): [B, n] fp64, a pure function of (seed[b], counter[b], j).

    The RNG contract of the pipelined MTP rounds: a request's draws depend only on its seed and the
    position of the round (the counter), never on the batch it shares, how many rounds are in flight
    or on the host; one call per round draws every uniform the round may need. 48 bits each (two
    24-bit halves of independent hashes)."""
    j = torch.arange(2 * n, device=seed.device, dtype=torch.int64)
    key = _mix32((counter[:, None] & _M32) ^ _mix32(j[None] + 0x9E3779B9))
    h = _mix32((seed[:, None] & _M32) ^ key ^ _mix32((seed[:, None] >> 32) & _M32))  # [B, 2n]
    hi, lo = (h[:, 0::2] >> 8).double(), (h[:, 1::2] >> 8).double()
    return (hi * 2.0 ** 24 + lo) * 2.0 ** -48


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] (need not be normalised) by inverse CDF at u [B] in [0, 1).
    The chosen token has positive mass: the first index whose CDF exceeds u * total."""
    cdf = probs.double().cumsum(-1)
    t = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, t, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)


# ------------------------------------------------------------------------------------------------
# plain decoding (k = 0): one token per row, on the device, nothing read back
# ------------------------------------------------------------------------------------------------
def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [B] int64, torch.argmax of each row. On a GPU, for a vocabulary of
    kernels/argmax.SPLIT_MIN_COLUMNS or more, the split kernel there (the same index: first maximum, NaN
    largest), which spreads a row over the SMs where torch.argmax reduces it in one thread block (27 of a
    2-layer slice step's 1110 µs at batch 1 and V = 129280, H100)."""
    if logits.device.type != "cuda":
        return logits.argmax(-1)
    from dsv4c.kernels.argmax import SPLIT_MIN_COLUMNS, argmax_rows
    if logits.shape[-1] < SPLIT_MIN_COLUMNS:
        return logits.argmax(-1)
    return argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous())


def sample_rows(logits: torch.Tensor, rp: RowParams, u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [B, V]: the argmax on greedy rows, else `draw_rows` at u [B] from the
    row's processed distribution (`processed_probs_rows`' stages; the final renormalisation and the
    one-hot rows are skipped: `draw_rows` scales by the row's total, greedy rows take the argmax).
    -> [B] int64. A handful of kernels, none of which waits for the host."""
    logits = logits.float()
    if rp.all_greedy:
        return greedy_rows(logits)
    x = logits / rp.divisor[:, None]
    if rp.any_top_k:
        V = x.shape[-1]
        kth = x.sort(-1, descending=True).values.gather(-1, (rp.top_k.clamp(1, V) - 1)[:, None])
        kth = torch.where((rp.top_k > 0)[:, None], kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if rp.any_top_p:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p < rp.top_p[:, None]) | (rp.top_p >= 1)[:, None]
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    if rp.any_min_p:
        probs = _min_p(probs, rp.min_p[:, None])
    tok = draw_rows(probs, u)
    if rp.any_greedy:
        tok = torch.where(rp.temperature == 0, greedy_rows(logits), tok)
    return tok


def sample_at(logits: torch.Tensor, p: SamplingParams, seed: int, n: int) -> int:
    """The token a request with `seed` samples from the logits [V] of position n (host; the module's
    RNG contract)."""
    if p.temperature == 0:
        return int(logits.argmax())
    u = counter_uniforms(torch.tensor([seed], dtype=torch.int64), torch.tensor([n], dtype=torch.int64), 1)[:, 0]
    return int(sample_rows(logits[None].float(), RowParams.of([p], "cpu"), u)[0])


class DecodeSampler:
    """`sample_rows` for the decode steps of one fixed batch of requests (their parameters and seeds),
    with the contract's uniforms: row b's token from the logits of position n uses
    counter_uniforms(seed_b, n, 1). Every row advances one position per step, so the uniforms of the
    next TABLE positions are computed at once (the hash is some 30 tiny kernels) and a step takes a
    column. `tokens` only queues device work."""

    TABLE = 64

    def __init__(self, params: list[SamplingParams], seeds: list[int], device, slots: list[int] | None = None,
                 penalty: PenaltyState | None = None):
        self.device = torch.device(device)
        self.rp = RowParams.of(params, self.device)
        self.seeds = _to(torch.tensor(seeds, dtype=torch.int64), self.device)
        self.base: list[int] | None = None  # the positions of the table's column 0
        self.table: torch.Tensor | None = None  # [B, TABLE] fp64
        self.penalty = None  # (state, slots [B], presence, frequency, repetition [B]) when a row is penalized
        if any(p.penalized for p in params):
            if penalty is None or slots is None:
                raise ValueError("DecodeSampler: penalized rows need the session's PenaltyState and their slots")
            pen = [torch.tensor([getattr(p, k) for p in params], dtype=torch.float32)
                   for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")]
            bias = None
            if any(p.logit_bias for p in params):  # dense [B, V]: one add per step
                bias = torch.zeros(len(params), penalty.counts.shape[1])
                for i, p in enumerate(params):
                    for t, b in p.logit_bias:
                        bias[i, t] += b
                bias = _to(bias, self.device)
            self.penalty = (penalty, _to(torch.tensor(slots, dtype=torch.int64), self.device),
                            *(_to(t, self.device) for t in pen), bias)

    def tokens(self, logits: torch.Tensor, pos: list[int]) -> torch.Tensor:
        """logits [B, V] of positions `pos` (host ints) -> tokens [B] int64 on the device (penalized rows:
        their counts take the tokens)."""
        if self.penalty is not None:
            state, slots, *pen = self.penalty
            u = None if self.rp.all_greedy else self.uniforms(pos)
            tok = sample_rows(state.apply(logits, slots, *pen), self.rp, u)
            state.count(slots, tok)
            return tok
        if self.rp.all_greedy:
            return greedy_rows(logits)
        return sample_rows(logits, self.rp, self.uniforms(pos))

    def uniforms(self, pos: list[int]) -> torch.Tensor:
        """u [B]: counter_uniforms(seed_b, pos[b], 1)[:, 0]."""
        off = None if self.base is None else {p - b for p, b in zip(pos, self.base)}
        if off is None or len(off) != 1 or not 0 <= next(iter(off)) < self.TABLE:
            self.base, off = list(pos), {0}
            B, L = len(pos), self.TABLE
            ctr = _to(torch.tensor(pos, dtype=torch.int64), self.device)[:, None] + torch.arange(L, device=self.device)
            seeds = self.seeds[:, None].expand(B, L).reshape(-1)  # (repeat_interleave may read its size back)
            self.table = counter_uniforms(seeds, ctr.reshape(-1), 1).view(B, L)
        return self.table[:, next(iter(off))]
