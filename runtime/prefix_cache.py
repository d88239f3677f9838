"""Exact prefix caching for the Session's slot caches: content-addressed blocks of prompt state.

A prompt is cut into blocks of `block_size` tokens (a multiple of every compression ratio, so a block
holds whole compressed entries). Block k is keyed by the hash chain h_k = H(h_{k-1}, ids[k·b:(k+1)·b]),
so a key names the whole prefix up to the block's end. A stored block holds, in a preallocated pool:

  growing rows   the per-sequence state of the block's positions: V4 `entries` / `idx_entries`
                 (b/m compressed entries per layer), V3/V3.2 `latent`, `kpe`, `index_keys` (b rows);
  boundary rows  the fixed-size state needed to resume at the block's end P (V4 only): the window
                 ring's rows of positions [P-W, P) and the compressors' kept rows of [P-(c-1)·m, P)
                 (CSA's previous group; HCA's open group is empty at a multiple of m, so none).

A request whose prompt starts with cached blocks gets its (reset) slot filled from them: every block's
growing rows plus the last block's boundary rows. That is the slot's state after prefilling those
positions: the ops read the ring only at [p-W+1, p) and the compressors only from the current group's
start minus (c-1)·m, so rows the restore leaves at their reset values are never read (masked, or
rewritten first). Only the rest of the prompt is prefilled. Logits equal a prefill from scratch up to
the float rounding of a different chunking (as chunked prefill; the tests hold 1e-6 in fp32).

**Why store the boundary state rather than recompute the window.** The ring at P holds every layer's
K=V rows of the last W positions. Layer l's row at p depends on layer l-1's attention over
[p-W+1, p], so recomputing it exactly needs L·(W-1)+1 tokens of full forward (V4-Flash: 5462 tokens,
more than most prompts; the slice: 509) plus a graph that skips rewriting the stored entries. Storing it
costs W·d bytes per layer per block (the slice at b = 128: 128 KiB of ring per layer, 0.66 MiB per
block in all), one copy at restore: microseconds against the milliseconds of a 509-token prefill.

**Snapshots.** Growing rows stay in the slot, but a chunk longer than the ring keeps only its last rows,
so boundary rows exist only at chunk ends. A block stored at a chunk end gets them; the prefill adds chunk
ends at the prompt's last full block and at the end of its cached match when that block lacks them (the
point where prompts sharing a prefix diverge, learnt from the second such request). A request resumes at
its deepest matched block with boundary rows. Models without boundary state (V3) resume at any block.

**References and eviction.** A request holds a reference on every block of its prompt (matched and newly
stored) until it finishes. Unreferenced blocks stay cached and are evicted least recently used, the
deepest of a chain first. A request whose new blocks cannot be had waits for running requests to release
theirs; a prompt with more full blocks than the pool holds is refused before any work.

**Generated blocks.** Chat and agent traffic sends the previous turns back, answers included. So a block
that plain decode steps complete is kept too (`after_decode`): right after the step that writes its last
position is queued, its growing rows and its boundary rows at the block end are copied into a pool row (in
stream order, before the next step can overwrite a ring row). When the request finishes, each such block
whose tokens it knows (prompt and output) is keyed by the hash chain and stored, unreferenced; a block
whose key is already stored gives its row back. Copying never waits: with no row to be had, the chain stops
there. MTP rounds keep theirs too: a round that accepts past a block end P calls the same hook for P. A
pipelined round is read after the next one is queued, and that round's writes may have overwritten ring
rows of [P-W, P) (a ring of W + K rows holds only K spare ones); such a round first copies the K + 1 ring
rows it overwrites aside (runtime/speculative.py, `stash_rings`), and the stored rows are patched from that
copy (`RingPatch`). Sharded runs' MTP rounds keep none (the followers hold no such copy).

**MTP.** The MTP draft of the first round needs the last W prompt positions' streams (V4's MTP block is
SWA), so with MTP a V4 request resumes no later than W tokens before its end; V3's MTP layer attends to
every prompt position, so V3 requests with MTP are not restored (their blocks are still stored). The
verify graph writes past the prompt into the slot only: stored blocks are copies, never written again.

**Sharded runs.** Rank 0's cache decides; each copy (`store_rows`, `store_boundary_row`, `restore_rows`) is
mirrored to the other ranks (`mirror`: runtime/distributed.py's Leader), which build the same pool and make
the same copy of their own caches.

Legend: b block size, P a block end (position), W window, m compress ratio, c overlap (2 for m = 4),
R kept compressor rows, N pool blocks.
"""
from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dsv4c.runtime.distributed import OP_BOUNDARY, OP_RESTORE, OP_STORE
from dsv4c.runtime.kv_cache import free_bytes


class PrefixCacheError(ValueError):
    """The prefix cache cannot be built or cannot serve a request; the message names the limit."""


@dataclass(frozen=True)
class PrefixCacheConfig:
    """block_size: tokens per block (default: the smallest multiple of every compression ratio that is at
    least 16). max_blocks: pool size (default: the slot caches' token capacity, max_batch x max_tokens,
    capped by max_bytes). max_bytes: pool bytes (default: a quarter of the free memory)."""
    block_size: int | None = None
    max_blocks: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class _Field:
    """How one flat cache tensor ([slots, rows, ...]) is stored per block."""
    name: str
    grow: bool  # True: rows of the block's positions (row = position // div); False: boundary rows
    rows: int   # rows per block
    div: int = 1  # growing: positions per row (m for compressed entries)
    ring: int = 0  # boundary: the tensor's rows R (position p at row p mod R)


@dataclass(frozen=True)
class RingPatch:
    """Ring rows that a round queued after a block end overwrote before that block's boundary rows were copied:
    the round started at position `start` and wrote positions start..start+K (K + 1 = the width of `rows`), so a
    field with ring R lost positions start + j - R; `rows[name][j]` holds what was there (this slot's rows of
    runtime/speculative.py's stash, read in stream order before the stash is written again)."""
    start: int
    rows: dict[str, torch.Tensor]  # field name -> [K + 1, ...]

    def apply(self, f: "_Field", lo: int, dst: torch.Tensor) -> None:
        """dst[i] holds position lo + i of field f: overwrite the positions the later round took."""
        src = self.rows.get(f.name)
        if src is None:
            return
        first = self.start - f.ring  # position of stash row 0
        j0, j1 = max(lo - first, 0), min(lo + dst.shape[0] - first, src.shape[0])
        if j0 < j1:
            dst[first + j0 - lo:first + j1 - lo] = src[j0:j1]


@dataclass
class _Block:
    key: bytes
    row: int  # pool row
    index: int  # block number k: positions [k·b, (k+1)·b)
    refs: int = 0
    boundary: bool = False  # boundary rows stored
    stored: bool = False  # growing rows stored (a pending block is reserved, not yet in the table)


@dataclass
class _Hold:
    """What one slot's request holds: its prompt's full blocks in order (matched, then new), and the blocks
    its decode steps completed after them (`after_decode`: copied, keyed when it finishes)."""
    matched: int  # blocks found in the table at admission
    blocks: list[_Block] = field(default_factory=list)
    decoded: list[_Block] = field(default_factory=list)
    decoding: bool = True  # False once a decode block could not be copied (the chain stops there)


def cache_fields(config, caches: dict[str, torch.Tensor]) -> list[_Field]:
    """The per-block storage plan of every cache tensor (names "{layer}.{field}", runtime/kv_cache.py)."""
    out = []
    for name, t in caches.items():
        layer, f = name.split(".", 1)
        if not config.is_v4:
            if f not in ("latent", "kpe", "index_keys"):
                raise PrefixCacheError(f"prefix cache: no storage rule for the V3 cache tensor {name!r}")
            out.append(_Field(name, True, 0))  # one row per position (rows per block: set by PrefixCache)
            continue
        m = config.compress_ratios[int(layer)]
        if f == "ring":
            out.append(_Field(name, False, config.sliding_window, ring=t.shape[1]))
        elif f in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
            mm = 4 if f.startswith("idx") else m
            n = mm if mm == 4 else 0  # (c-1)·m rows: CSA's previous group; none for HCA
            if n:
                out.append(_Field(name, False, n, ring=t.shape[1]))
        elif f in ("entries", "idx_entries"):
            out.append(_Field(name, True, 0, div=4 if f == "idx_entries" else m))
        else:
            raise PrefixCacheError(f"prefix cache: no storage rule for the V4 cache tensor {name!r}")
    return out


def default_block_size(config) -> int:
    ratios = [m for m in config.compress_ratios if m] if config.is_v4 else []
    base = math.lcm(*ratios) if ratios else 1
    return base * -(-16 // base)


class PrefixCache:
    """The block pool, the hash-chain table, per-slot references and LRU eviction (module docstring)."""

    def __init__(self, config, caches: dict[str, torch.Tensor], max_tokens: int, max_batch: int,
                 device: torch.device, cfg: PrefixCacheConfig = PrefixCacheConfig()):
        b = cfg.block_size or default_block_size(config)
        ratios = sorted({m for m in config.compress_ratios if m}) if config.is_v4 else []  # CSA's indexer: m = 4 too
        bad = [m for m in ratios if b % m]
        if b < 1 or bad:
            raise PrefixCacheError(f"PrefixCacheConfig.block_size={b}: must be >= 1 and a multiple of every "
                                   f"compression ratio (not of {bad})")
        self.block_size, self.device = b, device
        self.fields = [_Field(f.name, f.grow, b // f.div if f.grow else f.rows, f.div, f.ring)
                       for f in cache_fields(config, caches)]
        self.boundary_fields = [f for f in self.fields if not f.grow]
        self.has_boundary = bool(self.boundary_fields)
        self.window = config.sliding_window if config.is_v4 else 0
        self.is_v4 = config.is_v4
        row_bytes = {f.name: caches[f.name][0, 0].numel() * caches[f.name].dtype.itemsize for f in self.fields}
        self.bytes_per_block = sum(f.rows * row_bytes[f.name] for f in self.fields)
        n = cfg.max_blocks
        if n is None:
            cap = cfg.max_bytes if cfg.max_bytes is not None else free_bytes(device) // 4
            n = min(max_batch * (max_tokens // b), cap // max(self.bytes_per_block, 1))
        if n < 1:
            raise PrefixCacheError(f"prefix cache: no block fits (block_size={b} tokens, {self.bytes_per_block} bytes; "
                                   f"max_tokens={max_tokens}, max_blocks={cfg.max_blocks}, max_bytes={cfg.max_bytes}); "
                                   f"pass prefix_cache=False")
        self.n_blocks = n
        self.pool = {f.name: torch.empty((n, f.rows) + tuple(caches[f.name].shape[2:]), dtype=caches[f.name].dtype,
                                         device=device) for f in self.fields}
        self.caches = caches
        self.table: dict[bytes, _Block] = {}
        self.lru: OrderedDict[bytes, _Block] = OrderedDict()  # unreferenced stored blocks, oldest first
        self.free_rows = list(range(n))
        self.holds: dict[int, _Hold] = {}
        self.counters = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "stored_blocks": 0, "evictions": 0,
                         "waits": 0}
        self.mirror = None  # rank 0 of a sharded run: runtime/distributed.Leader, which mirrors every copy
        self.deferred: list | None = None  # restores asked for inside `batched_restores`
        self.deferred_stores: list | None = None  # stores asked for inside `batched_stores`

    # ---- keys -------------------------------------------------------------------------------------
    def keys(self, ids: list[int], start: int = 0, prev: bytes = b"") -> list[bytes]:
        """The hash chain of ids' full blocks (from block `start` on, continuing the chain from `prev`, the key of
        block start - 1)."""
        b, out, h = self.block_size, [], prev
        n = len(ids) // b
        if n <= start:
            return out
        raw = array("q", ids[start * b:n * b]).tobytes()  # int64 ids, native order: one conversion, sliced per block
        w = 8 * b
        for k in range(n - start):
            h = hashlib.blake2b(h + raw[k * w:(k + 1) * w], digest_size=16).digest()
            out.append(h)
        return out

    def check(self, ids: list[int], max_new: int = 0) -> None:
        """Refuse, before any work, a prompt with more full blocks than the pool holds."""
        need = len(ids) // self.block_size
        if need > self.n_blocks:
            raise PrefixCacheError(f"prefix cache pool too small: a {len(ids)}-token prompt needs {need} blocks of "
                                   f"{self.block_size} tokens, the pool holds {self.n_blocks} "
                                   f"({self.bytes_per_block} bytes each); raise PrefixCacheConfig.max_blocks "
                                   f"(or max_bytes) or pass prefix_cache=False")

    # ---- admission --------------------------------------------------------------------------------
    def admit(self, ids: list[int], slot: int, pos: torch.Tensor, mtp: bool = False, tokens: int | None = None,
              limit: int | None = None, keys: list[bytes] | None = None) -> bool:
        """Take the cached blocks of ids' prefix and reserve rows for its other full blocks; restore the
        (reset) `slot` from the deepest resumable block and set pos[slot]. False: the rows are held by
        running requests (wait for them). (`tokens`, `limit`: the paged BlockPool's; the slot holds every
        position here; `keys`: `keys(ids)` when the caller has them.)"""
        keys = self.keys(ids) if keys is None else keys
        j = 0
        while j < len(keys) and keys[j] in self.table:
            j += 1
        for k in keys[j:]:  # a stored block whose prefix was evicted: unreachable, drop it
            orphan = self.table.get(k)
            if orphan is not None and orphan.refs == 0:
                del self.table[k]
                self.lru.pop(k, None)
                self.free_rows.append(orphan.row)
        need = len(keys) - j
        matched = set(keys[:j])
        avail = len(self.free_rows) + sum(1 for k in self.lru if k not in matched)
        if need > avail:
            if not any(blk.refs for blk in self.table.values()) and not any(h.decoded for h in self.holds.values()):
                self.check(ids)
                raise PrefixCacheError(f"prefix cache: {need} free blocks needed, {avail} can be had")
            self.counters["waits"] += 1
            return False
        hold = _Hold(matched=j)
        for k in keys[:j]:
            blk = self.table[k]
            blk.refs += 1
            self.lru.pop(k, None)
            hold.blocks.append(blk)
        for k in range(j, len(keys)):
            hold.blocks.append(_Block(keys[k], self._take_row(), k, refs=1))
        self.holds[slot] = hold
        r = self._resume_blocks(hold, j, len(ids), mtp)
        if r:
            self.restore_rows([blk.row for blk in hold.blocks[:r]], slot)
        pos[slot] = r * self.block_size
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(ids)
        self.counters["hit_tokens"] += r * self.block_size
        return True

    def _resume_blocks(self, hold: _Hold, matched: int, n: int, mtp: bool) -> int:
        """How many blocks to restore: at most the matched ones, leaving >= 1 token to prefill (>= W
        with V4 MTP, none restored with V3 MTP), ending at a block with boundary rows."""
        if mtp and not self.is_v4:
            return 0
        keep = self.window if mtp else 1
        r = min(matched, max(n - keep, 0) // self.block_size)
        while r and self.has_boundary and not hold.blocks[r - 1].boundary:
            r -= 1
        return r

    def _take_row(self) -> int:
        if not self.free_rows:
            key, blk = self.lru.popitem(last=False)
            del self.table[key]
            self.counters["evictions"] += 1
            self.free_rows.append(blk.row)
        return self.free_rows.pop()

    def release(self, slot: int, tokens: list[int] | None = None) -> None:
        """The request in `slot` finished: store its decoded blocks that `tokens` (its prompt and output)
        cover, then drop its references (pending rows go back to the pool)."""
        hold = self.holds.pop(slot, None)
        if hold is None:
            return
        first = len(hold.blocks)  # the decoded blocks' chain goes on from the prompt's
        keys = self.keys(tokens, first, hold.blocks[-1].key if first else b"") if tokens and hold.decoded else []
        for blk in reversed(hold.decoded):  # the deepest first: evicted before its prefix
            key = keys[blk.index - first] if blk.index - first < len(keys) else None
            if key is None or key in self.table:
                self.free_rows.append(blk.row)
                continue
            blk.key, blk.stored, blk.refs = key, True, 0
            self.table[key] = blk
            self.lru[key] = blk
            self.counters["stored_blocks"] += 1
        for blk in reversed(hold.blocks):  # the deepest first: evicted before its prefix
            blk.refs -= 1
            if not blk.stored:
                self.free_rows.append(blk.row)
            elif blk.refs == 0:
                self.lru[blk.key] = blk

    def release_all(self) -> None:
        for s in list(self.holds):
            self.release(s)

    # ---- prefill hooks ----------------------------------------------------------------------------
    def chunk_ends(self, slot: int, start: int, n: int, step: int) -> list[int]:
        """Chunk ends for prefilling positions [start, n) of `slot`: every `step` tokens, plus the ends of
        the held blocks that would otherwise lack boundary rows and where a later prompt may resume: the
        last full block, the matched prefix's end (where prompts diverge), and the deepest block this very
        prompt could resume from again (>= 1 token, or W with MTP, left to prefill)."""
        cuts = set(range(start + step, n, step)) | {n}
        hold = self.holds.get(slot)
        if hold is not None and self.has_boundary:
            b = self.block_size
            for i in {len(hold.blocks), hold.matched, (n - 1) // b, max(n - self.window, 0) // b}:
                if 0 < i <= len(hold.blocks) and not hold.blocks[i - 1].boundary and start < i * b < n:
                    cuts.add(i * b)
        return sorted(cuts)

    def after_chunk(self, slot: int, end: int) -> None:
        """Positions [.., end) of `slot` are prefilled: store the held blocks that ended by then (their
        growing rows stay in the slot), and the boundary rows of the block ending at `end`."""
        hold = self.holds.get(slot)
        if hold is None:
            return
        b = self.block_size
        new = [blk for blk in hold.blocks if not blk.stored and (blk.index + 1) * b <= end]
        if new:
            self.store_rows([blk.row for blk in new], [blk.index for blk in new], slot)
            for blk in new:
                blk.stored = True
                other = self.table.get(blk.key)
                if other is None:
                    self.table[blk.key] = blk
                    continue
                # another request stored the same prefix meanwhile: share its block, return this row
                other.refs += 1
                self.lru.pop(blk.key, None)
                self.free_rows.append(blk.row)
                hold.blocks[blk.index] = other
            self.counters["stored_blocks"] += len(new)
        if self.has_boundary and end % b == 0 and 0 < end // b <= len(hold.blocks):
            last = hold.blocks[end // b - 1]
            if not last.boundary:
                self.store_boundary_row(last.row, slot, end)
                last.boundary = True

    # ---- decode hook ------------------------------------------------------------------------------
    def after_decode(self, slot: int, pos: int, patch: RingPatch | None = None) -> None:
        """A plain decode step (or an MTP round) that writes `slot`'s positions < `pos` is queued (read): if
        `pos` ends the block that follows the request's held ones, copy it (growing rows, and boundary rows at
        `pos`, patched by `patch`) into a pool row, keyed at release. Never evicts a referenced block and never
        waits: no row, no copy, and the chain stops."""
        b = self.block_size
        hold = self.holds.get(slot)
        if hold is None or not hold.decoding or pos % b or pos // b - 1 != len(hold.blocks) + len(hold.decoded):
            return
        if not self.free_rows and not self.lru:
            hold.decoding = False
            return
        k = pos // b - 1
        blk = _Block(b"", self._take_row(), k, refs=1, boundary=self.has_boundary)
        self.store_rows([blk.row], [k], slot)
        if self.has_boundary:
            self.store_boundary_row(blk.row, slot, pos, patch)
        hold.decoded.append(blk)

    # ---- copies (on a sharded run rank 0 mirrors each to the other ranks: runtime/distributed.py) ----------
    def batched_stores(self):
        """One-block and boundary stores asked for inside run when it ends, one set of copies for all the slots
        storing block number k (or boundary rows at position `end`) (the rows of one prefill call: the
        scheduler's `after_chunk` per row). The slots' rows must not change before then (the next graph
        call is queued after it)."""
        def run(src: tuple, items: list[tuple[int, int]]) -> None:
            what, at = src
            store = self._store_block if what == "rows" else self._store_boundary_rows
            store([r for r, _ in items], [s for _, s in items], at)

        return deferring(self, "deferred_stores", run)

    def _store_block(self, rows: list[int], slots: list[int], k: int) -> None:
        """Pool rows `rows` <- block number k of each of `slots` (growing fields)."""
        dst, src = torch.tensor(rows, device=self.device), torch.tensor(slots, device=self.device)
        for f in self.fields:
            if f.grow:
                self.pool[f.name][dst] = self.caches[f.name][src, k * f.rows:(k + 1) * f.rows]
        if self.mirror is not None:
            for row, slot in zip(rows, slots):
                self.mirror.prefix(OP_STORE, slot, rows=[row, k])

    def _store_boundary_rows(self, rows: list[int], slots: list[int], end: int) -> None:
        """Pool rows `rows` <- the boundary rows at position `end` of each of `slots`."""
        dst, src = torch.tensor(rows, device=self.device), torch.tensor(slots, device=self.device)
        for f in self.boundary_fields:
            idx = torch.arange(end - f.rows, end, device=self.device).remainder(f.ring)
            self.pool[f.name][dst] = self.caches[f.name][src[:, None], idx[None, :]]
        if self.mirror is not None:
            for row, slot in zip(rows, slots):
                self.mirror.prefix(OP_BOUNDARY, row, slot, end)

    def store_rows(self, rows: list[int], index: list[int], slot: int) -> None:
        """Copy the growing rows of `slot`'s blocks number `index` into pool rows `rows`. One block (a decode
        step's) is sliced: no index tensor to send, so the host never waits for the queued steps; inside
        `batched_stores`, one block is stored when that ends."""
        if len(rows) == 1 and self.deferred_stores is not None:
            self.deferred_stores.append((("rows", index[0]), (rows[0], slot)))
            return
        if len(rows) == 1:
            (row,), (k,) = rows, index
            for f in self.fields:
                if f.grow:
                    self.pool[f.name][row] = self.caches[f.name][slot, k * f.rows:(k + 1) * f.rows]
        else:
            dst = torch.tensor(rows, device=self.device)
            for f in self.fields:
                if f.grow:
                    src = torch.cat([torch.arange(k * f.rows, (k + 1) * f.rows) for k in index])
                    self.pool[f.name][dst] = self.caches[f.name][slot, src.to(self.device)].unflatten(
                        0, (len(rows), f.rows))
        if self.mirror is not None:
            self.mirror.prefix(OP_STORE, slot, rows=rows + index)

    def store_boundary_row(self, row: int, slot: int, end: int, patch: RingPatch | None = None) -> None:
        """Copy `slot`'s boundary rows at position `end` (a block end) into pool row `row`, then `patch`'s;
        inside `batched_stores` (no patch), when that ends."""
        if patch is not None and self.mirror is not None:
            raise PrefixCacheError("prefix cache: a ring patch cannot be mirrored to the other ranks")
        if patch is None and self.deferred_stores is not None:
            self.deferred_stores.append((("boundary", end), (row, slot)))
            return
        for f in self.boundary_fields:
            idx = torch.arange(end - f.rows, end, device=self.device).remainder(f.ring)
            self.pool[f.name][row] = self.caches[f.name][slot, idx]
            if patch is not None:
                patch.apply(f, end - f.rows, self.pool[f.name][row])
        if self.mirror is not None:
            self.mirror.prefix(OP_BOUNDARY, row, slot, end)

    def restore_rows(self, rows: list[int], slot: int) -> None:
        """Fill (reset) `slot` with the growing rows of pool rows `rows` (its first blocks, in order) and the
        boundary rows of the last; inside `batched_restores`, when that ends."""
        if self.deferred is not None:
            self.deferred.append((tuple(rows), slot))
            return
        self._restore(rows, [slot])

    def batched_restores(self):
        """Restores asked for inside run when it ends, one set of copies per distinct source for all the slots
        that take it (a wave of requests resuming from one cached prompt: one copy per field, not one per
        request and field). The slots must not be read before then (the scheduler admits a wave, then
        prefills it)."""
        return deferring(self, "deferred", lambda rows, slots: self._restore(list(rows), slots))

    def _restore(self, rows: list[int], slots: list[int]) -> None:
        src = torch.tensor(rows, device=self.device)
        dst = torch.tensor(slots, device=self.device)  # [S]
        P = len(rows) * self.block_size
        for f in self.fields:
            t = self.caches[f.name]
            if f.grow:  # [S, n, ...] = [n, ...] for every slot
                t[dst, : len(rows) * f.rows] = self.pool[f.name][src].flatten(0, 1)
            else:
                lo = max(P - f.rows, 0)
                idx = torch.arange(lo, P, device=self.device).remainder(f.ring)
                t[dst[:, None], idx[None, :]] = self.pool[f.name][rows[-1], lo - (P - f.rows):]
        if self.mirror is not None:
            for slot in slots:
                self.mirror.prefix(OP_RESTORE, slot, rows=rows)

    # ---- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        return {"block_size": self.block_size, "blocks_total": self.n_blocks, "bytes_per_block": self.bytes_per_block,
                "blocks_cached": len(self.table), "blocks_in_use": sum(1 for blk in self.table.values() if blk.refs),
                "hit_rate": c["hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0, **c}


@contextmanager
def deferring(owner, attr: str, run):
    """While inside, `owner.<attr>` collects (source, item) pairs (the copy methods append instead of copying);
    when it ends, `run(source, [items])` once per distinct source, in first-asked order."""
    setattr(owner, attr, [])
    try:
        yield
    finally:
        pending = getattr(owner, attr)
        setattr(owner, attr, None)
        grouped: dict = {}
        for src, item in pending:
            grouped.setdefault(src, []).append(item)
        for src, items in grouped.items():
            run(src, items)


def prefix_cache_for(sess, setting: bool | PrefixCacheConfig) -> PrefixCache | None:
    """The Session's prefix cache: False -> None; True -> the default config, or None (noted in
    sess.cache_info["prefix"]) where a block exceeds max_tokens or the default pool cannot hold one
    max_tokens prompt; a PrefixCacheConfig -> as given (errors name the limit)."""
    if setting is False or setting is None:
        return None
    cfg = PrefixCacheConfig() if setting is True else setting
    b = cfg.block_size or default_block_size(sess.config)
    if setting is True and sess.max_tokens < b:
        sess.cache_info["prefix"] = f"off: max_tokens={sess.max_tokens} is below one block of {b} tokens"
        return None
    pc = PrefixCache(sess.config, sess.caches, sess.max_tokens, sess.max_batch, sess.device, cfg)
    if setting is True and pc.n_blocks < sess.max_tokens // b:  # the default must not refuse long prompts
        sess.cache_info["prefix"] = (f"off: a quarter of the free memory holds {pc.n_blocks} blocks, fewer than "
                                     f"one max_tokens prompt needs ({sess.max_tokens // b})")
        return None
    sess.cache_info["prefix"] = {"blocks": pc.n_blocks, "block_size": pc.block_size,
                                 "bytes": pc.n_blocks * pc.bytes_per_block}
    return pc
