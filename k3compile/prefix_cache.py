"""The prefix-state cache (docs/architecture.md, "Prefix-state cache"): decode states of prompt prefixes, so that a
prompt that starts like an earlier one prefills only the rest.

K3 is hybrid: a KDA layer's state after n tokens is a fixed-size pair (conv window, recurrent state) that cannot be
cut back to a shorter prefix, and an MLA layer's is the cache of n rows. So the cache keeps, for every `block`
tokens of a prompt (positions block, 2·block, ...), one entry: the KDA states as they were after that position and
the MLA rows of that block only; the state after k blocks is the KDA states of entry k and the MLA rows of entries
1..k concatenated (the blocks of a long prompt are stored once, not once per snapshot).

An entry's key is a hash chained over the blocks (sha256 of the parent's key and the block's token ids); an entry
also holds its block's ids and its parent's key, and both `store` and `lookup` compare them on every block they
walk. So an entry is stored only under a chain of parents that spells its prefix, a parent stays while it has
children, and a lookup returns a state only for exactly the prompt's tokens, whatever the hashes do (a test
replaces the hash by one that collides all the time). Entries live under a byte budget, evicted
least recently used first among the leaves (an entry no other entry extends): an entry is only reachable through
its parents, so a parent goes after its children. A single row only (batch 1): a batch is made of rows
(state.join_rows). Thread-safe.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from k3compile.config import K3Config
from k3compile.errors import UserError
from k3compile.interface import Past, past_length

ROOT = b""


class PrefixCacheError(UserError):
    pass


def block_key(parent: bytes, tokens) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes()).digest()


@dataclass
class _Entry:
    parent: bytes
    tokens: tuple[int, ...]
    kda: dict[int, tuple[Tensor, Tensor]]  # layer -> (conv, recurrent) after the block
    mla: dict[int, tuple[Tensor, Tensor]]  # layer -> (latent rows, k_rope rows) of the block
    nbytes: int
    children: int = 0


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    def __init__(self, cfg: K3Config, block: int = 256, budget_bytes: int = 1 << 30) -> None:
        if block < 1:
            raise PrefixCacheError(f"the cache block must be at least 1 token, got {block}")
        if budget_bytes < 0:
            raise PrefixCacheError(f"the prefix cache's byte budget must be >= 0, got {budget_bytes}")
        self.cfg, self.block, self.budget = cfg, block, budget_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: list[int]) -> tuple[int, Past | None]:
        """(n, the state after tokens[:n]) for the longest cached prefix that leaves at least one token to run (the
        logits of the last one are what a request needs); (0, None) when none is cached."""
        with self._lock:
            self.stats.lookups += 1
            chain, parent = [], ROOT
            for start in range(0, len(tokens) - 1 - self.block + 1, self.block):
                block = tuple(int(t) for t in tokens[start:start + self.block])
                key = block_key(parent, block)
                entry = self._entries.get(key)
                if entry is None or entry.tokens != block or entry.parent != parent:
                    break
                chain.append(key)
                parent = key
            if not chain:
                return 0, None
            for key in reversed(chain):  # the parents end most recently used: children are evicted first
                self._entries.move_to_end(key)
            self.stats.hits += 1
            n = len(chain) * self.block
            self.stats.hit_tokens += n
            return n, self._assemble([self._entries[k] for k in chain])

    def _assemble(self, chain: list[_Entry]) -> Past:
        last = chain[-1]
        past = []
        for i in range(self.cfg.num_hidden_layers):
            if self.cfg.is_mla(i):
                past.append(tuple(torch.cat([e.mla[i][j] for e in chain], dim=1) for j in range(2)))
            else:
                past.append(tuple(t.clone() for t in last.kda[i]))
        return past

    def store(self, tokens: list[int], past: Past) -> bool:
        """Keep `past`, the state (batch 1, host tensors) after `tokens`, whose length is a whole number of blocks,
        as the entry of its last block; its parent block must be cached (a prefill stores its blocks in order).
        False when it is not kept (no parent, or larger than the whole budget)."""
        n = len(tokens)
        if n == 0 or n % self.block:
            raise PrefixCacheError(f"a cached prefix is a whole number of {self.block}-token blocks, got {n} tokens")
        if past_length(self.cfg, past) not in (n, 0):
            raise PrefixCacheError(f"the state holds {past_length(self.cfg, past)} tokens, the prefix {n}")
        with self._lock:
            parent = ROOT
            for start in range(0, n - self.block, self.block):  # the parents, each holding exactly its block
                block = tuple(int(t) for t in tokens[start:start + self.block])
                key = block_key(parent, block)
                entry = self._entries.get(key)
                if entry is None or entry.tokens != block or entry.parent != parent:
                    return False
                parent = key
            block = tuple(int(t) for t in tokens[n - self.block:])
            key = block_key(parent, block)
            if key in self._entries:  # this prefix's, or (a hash collision) another's: either way it stays
                self._entries.move_to_end(key)
                return self._entries[key].tokens == block and self._entries[key].parent == parent
            kda, mla = {}, {}
            for i, (a, b) in enumerate(past):
                if a.shape[0] != 1:
                    raise PrefixCacheError(f"the prefix cache holds single rows, got a batch of {a.shape[0]}")
                if self.cfg.is_mla(i):
                    mla[i] = (a[:, n - self.block:].clone(), b[:, n - self.block:].clone())
                else:
                    kda[i] = (a.clone(), b.clone())
            size = sum(t.numel() * t.element_size() for d in (kda, mla) for pair in d.values() for t in pair)
            if size > self.budget:
                return False
            self._entries[key] = _Entry(parent, block, kda, mla, size)
            if parent != ROOT:
                self._entries[parent].children += 1
                self._entries.move_to_end(parent)
                self._entries.move_to_end(key)
            self.bytes += size
            self.stats.stored += 1
            self._evict()
            return key in self._entries

    def _evict(self) -> None:
        while self.bytes > self.budget:
            key = next((k for k, e in self._entries.items() if e.children == 0), None)
            if key is None:  # cannot happen: a chain always ends in a leaf
                return
            entry = self._entries.pop(key)
            self.bytes -= entry.nbytes
            self.stats.evicted += 1
            if entry.parent != ROOT and entry.parent in self._entries:
                self._entries[entry.parent].children -= 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
