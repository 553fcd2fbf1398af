"""Prefix-aware routing of vkengine's Ray Serve replicas (server/ray_app.py):
Ray Serve's request-router interface, so this module needs ray."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter

from vkengine.serving.runner import GenRequest

BLOCK = 32                 # prompt tokens a routing block covers


def prefix_blocks(prompt, block: int = BLOCK) -> list[bytes]:
    """Chained digests of a prompt's whole leading blocks of `block` token ids:
    entry i names the prompt's first (i + 1) * block tokens."""
    out, h = [], hashlib.blake2b(digest_size=16)
    ids = list(prompt)
    for i in range(len(ids) // block):
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in ids[i * block:(i + 1) * block]))
        out.append(h.copy().digest())
    return out



class PrefixRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """A request goes to the replica that last served the longest run of its
    prompt's leading token blocks (where that replica's prefix cache most
    likely still holds them) unless that replica's queue is longer than the
    least-loaded candidate's by more than `imbalance`; otherwise, and for a
    prefix seen nowhere, Ray's power of two choices (the least-loaded of two
    random replicas). Its map of block digests (LRU, max_blocks) is this
    router's: each ingress replica keeps its own. A call with a `replica`
    keyword (VkReplica.stats) goes to that replica."""

    def initialize_state(self, imbalance: int = 4, max_blocks: int = 200_000, **kw) -> None:
        self.imbalance, self.max_blocks = imbalance, max_blocks
        self.owner: OrderedDict[bytes, Any] = OrderedDict()   # block digest -> replica id

    @staticmethod
    def _prompt(pending) -> list[int] | None:
        for a in (pending.args or ()) if pending is not None else ():
            if isinstance(a, GenRequest):
                return list(a.prompt)
        return None

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        pinned = (pending_request.kwargs or {}).get("replica") if pending_request is not None else None
        if pinned is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pinned]]
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        prompt = self._prompt(pending_request)
        if not prompt or not fallback:
            return fallback
        by_id = {r.replica_id: r for r in candidate_replicas}
        best = None
        for d in prefix_blocks(prompt):
            rid = self.owner.get(d)
            if rid is None or rid not in by_id:
                break
            best = rid
        if best is None:
            return fallback
        lens, missing = {}, []            # queue lengths: the router's recent ones, else asked of the replicas
        for r in candidate_replicas:
            q = self.replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                lens[r] = q
        if missing:
            lens.update(dict(await self._probe_queue_lens(missing, 0)))
        known = [q for q in lens.values() if q is not None]
        mine = lens.get(by_id[best])
        if mine is not None and (mine >= by_id[best].max_ongoing_requests
                                 or (known and mine - min(known) > self.imbalance)):
            return fallback               # its replica is full or busy: the least-loaded of two instead
        return [[by_id[best]]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        for d in prefix_blocks(self._prompt(pending_request) or []):
            self.owner[d] = replica_id
            self.owner.move_to_end(d)
        while len(self.owner) > self.max_blocks:
            self.owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        for d in [d for d, r in self.owner.items() if r == replica_id]:
            del self.owner[d]
