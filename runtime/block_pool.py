"""Block-based (paged) caches for the Session: the pool's blocks, block tables, copy-free prefix sharing.

With a paged artifact (`dsv4c.model.common.PagedLayout`) the caches that grow with the sequence (V4:
compressed entries and the CSA indexer's keys; V3/V3.2: latent, kpe, indexer keys) are pools of
`N + 1` blocks of `b` positions shared by every sequence, and the graphs read and write them through
`caches["block_table"] [cache_slots, ⌈max_tokens / b⌉]` (the last pool block is scratch: unused table
entries point at it). The window ring and the compressors' open-group rows stay per slot. So the memory
of the growing caches is N blocks, not max_batch × max_tokens positions.

**Allocation (grown, not reserved).** A request takes, at admission, the blocks its prompt needs; the
scheduler (runtime/session.py `_Scheduler`) gives it one more block each time a step is about to write
past its last block (`grow`: a free block, else the least recently used unreferenced cached block,
evicted). A request whose prompt blocks cannot be had waits for running requests to finish. When a
decode step (or MTP round) needs a block and none can be had, the scheduler preempts the most recently
admitted running request: its blocks go back (its registered prompt blocks stay cached), it returns to
the head of the waiting queue with the tokens it generated, and no request is admitted until a running
one finishes; it then resumes by prefilling prompt + generated tokens (sharing its cached blocks again)
and goes on from its last token. A request that needs more blocks than the whole pool (prompt +
max_new_tokens) is refused before any work (`PagedCacheError` naming the limit), so the oldest running
request can always grow. The block table keeps its fixed shape (unused entries point at scratch), so the
graphs stay capturable. The table row of a finished request points at scratch again.

**Prefix sharing (copy-free).** As in runtime/prefix_cache.py, a prompt's full blocks are keyed by the
hash chain of their token ids; once prefilled, a block is registered under its key. A later prompt that
starts with registered blocks puts those very blocks into its table (reference-counted): nothing is
copied for the growing caches. It resumes at the end of the deepest shared block that has boundary state
(V4: the ring's last W rows and CSA's previous compressor group at that position, stored with the block
when a prefill chunk ended there; runtime/prefix_cache.py says why storing beats recomputing), restored
into its slot by one copy. Shared blocks are never written again: a request resumes at a block end
P = r·b and writes only positions >= P (the compressors write an entry when its group closes, and every
group of a block before P closed before P), and matched blocks past its resume point are not shared
(it gets private blocks for them). Unreferenced registered blocks stay cached and are evicted least
recently used, the deepest of a chain first, when a request needs blocks.

**Sharded (tp/ep).** Each rank has its own pool; this (rank 0's) pool decides the blocks and the leader sends
the table to the other ranks when it changed (`version`; runtime/distributed.py), so a shared block holds each
rank's own rows of the same tokens. The boundary copies (`store_boundary`, `restore_boundary`,
`forget_boundary`) are mirrored (`mirror`: the Leader): every rank stores and restores its own slot's rows.

**MTP.** A draft/verify round writes positions n..n+k: the scheduler grows the blocks to cover them before
the round is queued (pipelined rounds queue the next round only when its blocks can be had without
preempting). Rollback only moves the position: blocks past the kept length stay with the sequence and the
next round rewrites their rows (they go back when it finishes). Every write is at a position >= n, past
the resume point, so shared prefix blocks are never written. The MTP block's own caches (V4: its window
ring; V3: its latent) stay per slot. With MTP a V4 request resumes at least W tokens before its prompt's
end (the first draft needs their streams, as runtime/prefix_cache.py); V3 with MTP shares nothing.

**Generated blocks.** As runtime/prefix_cache.py keeps them: a block after the prompt's that a plain decode
step completes gets its boundary state stored right after that step is queued (`after_decode`), and when
the request finishes the block is registered under the key of the tokens it holds (prompt and output), if
it knows them, instead of going back free; MTP rounds' too (patched as runtime/prefix_cache.py says). A
preempted request's are not kept.

Legend: b block size (positions), N pool blocks, W window, P a block end (position).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from dsv4c.runtime.distributed import OP_PAGED_FORGET, OP_PAGED_RESTORE, OP_PAGED_STORE
from dsv4c.runtime.prefix_cache import PrefixCache, RingPatch, cache_fields, default_block_size, deferring


class PagedCacheError(ValueError):
    """The block pool cannot serve a request (or cannot be built); the message names the limit."""


@dataclass(frozen=True)
class PagedConfig:
    """Paged caches at compile time: block_size (default: the prefix cache's, the smallest multiple of every
    compression ratio >= 16) and max_blocks, the pool (default: max_batch × ⌈max_tokens / b⌉, the slot
    caches' capacity; fewer blocks = less memory: blocks are taken as tokens grow, and requests wait or are
    preempted when none is left)."""
    block_size: int | None = None
    max_blocks: int | None = None

    def layout(self, config, max_tokens: int, max_batch: int):
        from dsv4c.model.common import PagedLayout

        b = self.block_size or default_block_size(config)
        ratios = sorted({m for m in config.compress_ratios if m}) if config.is_v4 else []
        bad = [m for m in ratios if b % m]
        if b < 1 or bad:
            raise PagedCacheError(f"PagedConfig.block_size={b}: must be >= 1 and a multiple of every compression "
                                  f"ratio (not of {bad})")
        n = self.max_blocks if self.max_blocks is not None else max_batch * -(-max_tokens // b)
        if n < 1:
            raise PagedCacheError(f"PagedConfig.max_blocks={n}: the pool needs at least one block")
        return PagedLayout(b, n)


def paged_names(caches: dict[str, torch.Tensor]) -> set[str]:
    """The flat cache names of the pools (not per slot): the growing fields and the block table."""
    grow = ("entries", "idx_entries", "latent", "kpe", "index_keys")
    return {k for k in caches if k == "block_table" or k.split(".", 1)[-1] in grow}


@dataclass
class _Seq:
    blocks: list[int]  # pool block of each of the sequence's blocks, in order
    keys: list[bytes]  # hash-chain keys of its prompt's full blocks
    shared: int  # leading blocks taken from the cache (registered by another request)
    matched: int  # leading prompt blocks found in the cache at admission
    limit: int  # positions the sequence can ever write (prompt + max_new_tokens): growth stops there
    decoded: int = 0  # blocks after the prompt's that decode steps completed (`after_decode`), keyed at release


class BlockPool:
    """Blocks, block tables, registration, references and LRU eviction (module docstring). Implements the
    Session's prefix-cache hooks (admit, check, chunk_ends, after_chunk, release, stats)."""

    def __init__(self, config, caches: dict[str, torch.Tensor], layout, max_batch: int, max_tokens: int,
                 device: torch.device, share: bool = True):
        self.config, self.caches, self.device, self.share = config, caches, device, share
        self.block_size, self.n_blocks = layout.block_size, layout.n_blocks
        self.table_dev = caches["block_table"]  # [cache_slots, nb] int64, read by the graphs
        self.table = torch.full(tuple(self.table_dev.shape), self.n_blocks, dtype=torch.int64)
        self.table_dev.copy_(self.table)  # every row scratch (the caches were allocated as zeros: block 0)
        self.max_tokens = max_tokens
        slot_caches = {k: v for k, v in caches.items() if k not in paged_names(caches)}
        self.boundary_fields = [f for f in cache_fields(config, slot_caches) if not f.grow]
        self.window = config.sliding_window if config.is_v4 else 0
        self.refs = [0] * self.n_blocks
        self.key_of: dict[int, bytes] = {}  # registered block -> key
        self.by_key: dict[bytes, int] = {}
        self.boundary: dict[int, dict[str, torch.Tensor]] = {}  # registered block -> boundary rows at its end
        self.lru: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced blocks, oldest first
        self.free = list(range(self.n_blocks - 1, -1, -1))
        self.seqs: dict[int, _Seq] = {}
        self.covered = torch.zeros(self.table.shape[0], dtype=torch.int64)  # positions each slot's blocks cover
        self._table_np, self._covered_np = self.table.numpy(), self.covered.numpy()  # views: cheap row writes
        self.peak = 0  # most blocks held by sequences at once
        self.dirty: set[int] = set()  # slots whose table rows changed on the host only; flush() sends them
        self.version = 0  # bumped at every table change (a sharded run's leader sends the table when it moved)
        self.counters = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "stored_blocks": 0, "evictions": 0,
                         "waits": 0, "preemptions": 0}
        self.mirror = None  # rank 0 of a sharded run: runtime/distributed.Leader, which mirrors the boundary copies
        self.deferred: list | None = None  # restores asked for inside `batched_restores`
        self.deferred_stores: list | None = None  # stores asked for inside `batched_stores`

    def keys(self, ids: list[int], start: int = 0, prev: bytes = b"") -> list[bytes]:
        """The hash chain of ids' full blocks (runtime/prefix_cache.py's keys)."""
        return PrefixCache.keys(self, ids, start, prev)

    def _has_boundary(self, key: bytes) -> bool:
        return self.by_key.get(key) in self.boundary

    # ---- admission ------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def check(self, ids: list[int], max_new: int = 1) -> None:
        """Refuse, before any work, a request needing more blocks than the pool holds."""
        need = self.blocks_for(len(ids) + max_new)
        if need > self.n_blocks:
            raise PagedCacheError(f"paged cache pool too small: a {len(ids)}-token prompt with max_new_tokens="
                                  f"{max_new} needs {need} blocks of {self.block_size} tokens, the pool holds "
                                  f"{self.n_blocks} (PagedConfig.max_blocks); compile with more blocks")

    def admit(self, ids: list[int], slot: int, pos: torch.Tensor, mtp: bool = False, tokens: int | None = None,
              limit: int | None = None, keys: list[bytes] | None = None) -> bool:
        """Give `slot` the blocks of positions [0, tokens) (default len(ids): the prompt's): the cached blocks
        of ids' prefix up to the resume point, fresh ones after; restore the slot's boundary state there and
        set pos[slot]. `limit`: positions it can ever write (growth stops there; default max_tokens). False:
        the blocks are held by running requests (wait for one to finish). `keys`: `keys(ids)` when the caller
        has them (used only while sharing)."""
        tokens = tokens if tokens is not None else len(ids)
        self.release(slot)
        keys = (self.keys(ids) if keys is None else keys) if self.share else []
        j = 0
        while j < len(keys) and keys[j] in self.by_key:
            j += 1
        for k in keys[j:]:  # a registered block whose prefix was evicted is unreachable: free it
            blk = self.by_key.get(k)
            if blk is not None and self.refs[blk] == 0:
                self.lru.pop(blk, None)
                self._forget(blk)
                self.free.append(blk)
        r = self._resume(keys[:j], len(ids), mtp)
        shared = [self.by_key[k] for k in keys[:r]]
        need = max(self.blocks_for(tokens) - r, 0)
        avail = len(self.free) + sum(1 for blk in self.lru if blk not in shared)
        if need > avail:
            if not self.seqs:
                self.check(ids, max(tokens - len(ids), 0))
                raise PagedCacheError(f"paged cache: {need} free blocks needed, {avail} can be had")
            self.counters["waits"] += 1
            return False
        for blk in shared:
            self.refs[blk] += 1
            self.lru.pop(blk, None)
        blocks = shared + [self._take() for _ in range(need)]
        self.seqs[slot] = _Seq(blocks, keys, r, j, limit if limit is not None else self.max_tokens)
        self._set_row(slot, push=False)  # on the device from the next flush (before its first step)
        if r:
            self.restore_boundary(shared[-1], slot, r * self.block_size)
        pos[slot] = r * self.block_size
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(ids)
        self.counters["hit_tokens"] += r * self.block_size
        return True

    def _resume(self, matched: list[bytes], n: int, mtp: bool = False) -> int:
        """How many matched blocks to share: leaving >= 1 token to prefill (>= W with V4 MTP: the first draft
        needs the last W streams; none shared with V3 MTP, whose MTP cache needs every position's stream),
        ending at a block with boundary state (V4; V3 has none and resumes at any block)."""
        if mtp and not self.config.is_v4:
            return 0
        keep = self.window if mtp else 1
        r = min(len(matched), max(n - keep, 0) // self.block_size)
        while r and self.boundary_fields and self.by_key[matched[r - 1]] not in self.boundary:
            r -= 1
        return r

    def _take(self) -> int:
        if not self.free:
            blk, _ = self.lru.popitem(last=False)
            self._forget(blk)
            self.counters["evictions"] += 1
            return blk
        return self.free.pop()

    def _forget(self, blk: int) -> None:
        key = self.key_of.pop(blk, None)
        if key is not None:
            del self.by_key[key]
        self.forget_boundary(blk)

    def grow(self, slot: int, end: int, push: bool = True) -> bool:
        """Blocks for positions [0, min(end, the sequence's limit)) of `slot`: free ones, else evicted least
        recently used cached ones. All or none: False when they cannot be had (the scheduler preempts).
        `push=False`: the device's table is updated by the next `flush` (one copy for a step's growth)."""
        seq = self.seqs.get(slot)
        if seq is None:
            seq = self.seqs[slot] = _Seq([], [], 0, 0, self.max_tokens)
        need = self.blocks_for(min(end, seq.limit)) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(self.free) + len(self.lru):
            return False
        seq.blocks += [self._take() for _ in range(need)]
        self._set_row(slot, push)
        return True

    def grow_all(self, slots: list[int], ends: list[int]) -> bool:
        """`grow` each of `slots` (in this order) to its end, then one `flush`. True when all could grow."""
        cover = self.covered.numpy()
        if all(e <= cover[s] for s, e in zip(slots, ends)):  # the common step: no block end crossed
            return True
        ok = all([self.grow(s, e, push=False) for s, e in zip(slots, ends)])
        self.flush()
        return ok

    def flush(self) -> None:
        """Send the table rows changed on the host since the last flush to the device, in stream order: the
        steps queued before it read the old rows, those queued after it the new ones, so a row is never
        rewritten under a step that reads it. The host does not wait: the rows go from a pinned snapshot
        (the caching host allocator keeps it until the copy ran) in non-blocking copies, and the device
        scatters them. `Session._run` (and the speculator's runs) flush before queuing a graph."""
        if not self.dirty:
            return
        rows = sorted(self.dirty)
        self.dirty = set()
        if not self.table_dev.is_cuda:
            self.table_dev[rows] = self.table[rows]
            return
        src = self.table[rows].pin_memory().to(self.device, non_blocking=True)             # [r, nb]
        idx = torch.tensor(rows, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        self.table_dev.index_copy_(0, idx, src)

    def ensure(self, slot: int, end: int) -> None:
        """`grow`, or PagedCacheError naming the limit (Session._run: a step about to write past the blocks
        its sequence holds; Session.logits, which admits nothing, grows this way)."""
        if not self.grow(slot, end):
            have = len(self.free) + len(self.lru)
            raise PagedCacheError(f"paged cache: position {end} of slot {slot} needs more blocks of "
                                  f"{self.block_size} tokens than the {have} that can be had of {self.n_blocks} "
                                  f"(PagedConfig.max_blocks)")

    def holds(self, slot: int) -> int:
        """Positions the blocks of `slot` cover."""
        return int(self.covered[slot])

    def _set_row(self, slot: int, push: bool = True) -> None:
        """Write `slot`'s table row on the host; `push`: flush at once, else at the next flush. Through numpy
        views of the host tensors: a torch row write and tensor per call cost ~9x as much, and a decode step
        where 64 requests cross a block end (or finish) writes 64 rows."""
        row = self._table_np[slot]
        row.fill(self.n_blocks)
        blocks = self.seqs[slot].blocks if slot in self.seqs else []
        row[: len(blocks)] = blocks
        self.version += 1
        self.dirty.add(slot)
        if push:
            self.flush()
        self._covered_np[slot] = len(blocks) * self.block_size
        self.peak = max(self.peak, self.n_blocks - len(self.free) - len(self.lru))

    def release(self, slot: int, tokens: list[int] | None = None) -> None:
        """The request in `slot` finished: register the blocks its decode steps completed that `tokens` (its
        prompt and output) cover, drop its references; its table row points at scratch again (on the device
        from the next flush: no graph reads a free slot's row, and the requests finishing at one step cost one
        copy, not one each)."""
        seq = self.seqs.pop(slot, None)
        if seq is None:
            return
        first = len(seq.keys)  # the decoded blocks' chain goes on from the prompt's
        keys = self.keys(tokens, first, seq.keys[-1] if first else b"") if tokens and seq.decoded else []
        for i in range(first, first + seq.decoded):
            blk, key = seq.blocks[i], keys[i - first] if i - first < len(keys) else None
            if key is None or key in self.by_key:
                self.forget_boundary(blk)
                continue
            self.key_of[blk], self.by_key[key] = key, blk
            self.refs[blk] = 1  # dropped to 0 below: cached, unreferenced
            self.counters["stored_blocks"] += 1
        for blk in reversed(seq.blocks):  # the deepest first: evicted before its prefix
            if blk in self.key_of:
                self.refs[blk] -= 1
                if self.refs[blk] == 0:
                    self.lru[blk] = None
            else:
                self.free.append(blk)
        self._set_row(slot, push=False)

    def release_all(self) -> None:
        for s in list(self.seqs):
            self.release(s)

    # ---- prefill hooks ----------------------------------------------------------------------------
    def chunk_ends(self, slot: int, start: int, n: int, step: int) -> list[int]:
        """Chunk ends for prefilling [start, n): every `step` tokens, plus the block ends where a later
        prompt may resume and boundary state is missing (as PrefixCache.chunk_ends)."""
        cuts = set(range(start + step, n, step)) | {n}
        seq = self.seqs.get(slot)
        if seq is not None and self.share and self.boundary_fields:
            b, nk = self.block_size, len(seq.keys)
            for i in {nk, seq.matched, (n - 1) // b}:
                if 0 < i <= nk and start < i * b < n and not self._has_boundary(seq.keys[i - 1]):
                    cuts.add(i * b)
        return sorted(cuts)

    def after_chunk(self, slot: int, end: int) -> None:
        """Positions [.., end) of `slot` are prefilled: register its prompt blocks that ended by then (not
        already registered: a duplicate stays private), and store the boundary state at `end`."""
        seq = self.seqs.get(slot)
        if seq is None or not self.share:
            return
        b = self.block_size
        for i in range(seq.shared, min(end // b, len(seq.keys))):
            blk, key = seq.blocks[i], seq.keys[i]
            if blk in self.key_of or key in self.by_key:
                continue
            self.key_of[blk], self.by_key[key] = key, blk
            self.refs[blk] = 1
            self.counters["stored_blocks"] += 1
        if self.boundary_fields and end % b == 0 and 0 < end // b <= len(seq.keys):
            blk = self.by_key.get(seq.keys[end // b - 1])  # this slot's block, or the registered duplicate's
            if blk is not None and blk not in self.boundary:
                self.store_boundary(blk, slot, end)

    def after_decode(self, slot: int, pos: int, patch: RingPatch | None = None) -> None:
        """A plain decode step (or an MTP round) that writes `slot`'s positions < `pos` is queued (read): if
        `pos` ends the block after the prompt's and the ones decoded so far, store its boundary state (patched
        by `patch`, as PrefixCache.after_decode; registered at release)."""
        seq = self.seqs.get(slot)
        k = pos // self.block_size - 1
        if (not self.share or seq is None or pos % self.block_size or k != len(seq.keys) + seq.decoded
                or k >= len(seq.blocks)):
            return
        if self.boundary_fields:
            self.store_boundary(seq.blocks[k], slot, pos, patch)
        seq.decoded += 1

    def _rows(self, f, end: int) -> torch.Tensor:
        """The slot rows of field f holding positions [max(end - rows, 0), end)."""
        return torch.arange(max(end - f.rows, 0), end, device=self.device).remainder(f.ring)

    # ---- boundary copies (on a sharded run rank 0 mirrors each to the other ranks: runtime/distributed.py) --
    def store_boundary(self, blk: int, slot: int, end: int, patch: RingPatch | None = None) -> None:
        """Keep `slot`'s boundary rows at position `end` (the end of block `blk`) with the block, then `patch`'s;
        inside `batched_stores` (no patch), when that ends."""
        if patch is not None and self.mirror is not None:
            raise PagedCacheError("paged cache: a ring patch cannot be mirrored to the other ranks")
        if patch is None and self.deferred_stores is not None:
            self.deferred_stores.append((end, (blk, slot)))
            return
        self.boundary[blk] = {f.name: self.caches[f.name][slot, self._rows(f, end)].clone()
                              for f in self.boundary_fields}
        if patch is not None:
            for f in self.boundary_fields:
                patch.apply(f, max(end - f.rows, 0), self.boundary[blk][f.name])
        if self.mirror is not None:
            self.mirror.prefix(OP_PAGED_STORE, blk, slot, end)

    def batched_stores(self):
        """Boundary stores asked for inside run when it ends, one gather per field for all the slots storing at
        the same position (runtime/prefix_cache.py's `batched_stores`)."""
        return deferring(self, "deferred_stores",
                         lambda end, items: self._store_boundaries([b for b, _ in items], [s for _, s in items], end))

    def _store_boundaries(self, blks: list[int], slots: list[int], end: int) -> None:
        src = torch.tensor(slots, device=self.device)[:, None]  # [S, 1]
        rows = {f.name: self.caches[f.name][src, self._rows(f, end)[None, :]] for f in self.boundary_fields}
        for i, blk in enumerate(blks):  # each block keeps its view of the gathered rows [m, ...]
            self.boundary[blk] = {name: g[i] for name, g in rows.items()}
        if self.mirror is not None:
            for blk, slot in zip(blks, slots):
                self.mirror.prefix(OP_PAGED_STORE, blk, slot, end)

    def restore_boundary(self, blk: int, slot: int, end: int) -> None:
        """Write block `blk`'s boundary rows into `slot` (resuming at position `end`); inside
        `batched_restores`, when that ends."""
        if self.deferred is not None:
            self.deferred.append(((blk, end), slot))
            return
        self._restore_boundary(blk, [slot], end)

    def batched_restores(self):
        """Restores asked for inside run when it ends, one copy per field for all the slots resuming at the
        same block and position (runtime/prefix_cache.py's `batched_restores`)."""
        return deferring(self, "deferred", lambda src, slots: self._restore_boundary(src[0], slots, src[1]))

    def _restore_boundary(self, blk: int, slots: list[int], end: int) -> None:
        dst = torch.tensor(slots, device=self.device)[:, None]  # [S, 1]
        for f in self.boundary_fields:
            self.caches[f.name][dst, self._rows(f, end)[None, :]] = self.boundary[blk][f.name]
        if self.mirror is not None:
            for slot in slots:
                self.mirror.prefix(OP_PAGED_RESTORE, blk, slot, end)

    def forget_boundary(self, blk: int) -> None:
        if self.boundary.pop(blk, None) is not None and self.mirror is not None:
            self.mirror.prefix(OP_PAGED_FORGET, blk)

    # ---- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        used = self.n_blocks - len(self.free) - len(self.lru)
        return {"block_size": self.block_size, "blocks_total": self.n_blocks, "blocks_in_use": used,
                "peak_blocks_in_use": self.peak,
                "blocks_cached": len(self.key_of), "blocks_free": len(self.free),
                "hit_rate": c["hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0, **c}


def paged_bytes(caches: dict[str, torch.Tensor]) -> int:
    """Bytes of the pools (all blocks, scratch included)."""
    return sum(t.numel() * t.element_size() for k, t in caches.items() if k in paged_names(caches))
