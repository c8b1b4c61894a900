"""Which data-parallel replica gets a request (pure Python, no Ray: tested on its own).

Three policies, as vLLM's and SGLang's routers have them:
- round_robin: the next replica that is up.
- least_loaded: vLLM's internal balancer.  A replica's load is waiting x 4 + running.
  The front end knows exactly how many of its requests a replica holds (sent, not yet
  ended); of those, the waiting ones are what the replica last reported (polled every
  ~0.1 s, with how many requests it had received then) plus every request sent that the
  report had not seen: a request counts as waiting the moment it is sent
  ("optimistic"), so a burst between two reports still spreads, and a report taken just
  before a request ended never counts it.
- cache_aware (default): SGLang router's policy, over block hashes instead of text.
  Each replica has an approximate prefix index: the chained block hashes
  (core/kv_cache_utils.py, the keys the replica's own prefix cache uses) of the prompts
  it was sent, least recently sent evicted first once it holds as many blocks as the
  replica's KV cache.  The replica whose index matches the longest run of the prompt's
  leading blocks wins when that run covers at least `cache_threshold` of the prompt;
  otherwise the least loaded replica wins, ties going to the smaller index (the one with
  room to cache more).  An imbalance guard overrides affinity: when the busiest
  replica's load exceeds the idlest's by more than `balance_abs_threshold` and by more
  than `balance_rel_threshold` times, the least loaded replica gets the request.

The index is approximate on purpose: a replica's cache may have evicted what the index
still lists, or hold blocks the index never saw (another salt's).  A wrong guess costs
one recomputed prefix, never a wrong answer.  A replica that restarts comes back with
an empty cache, so its index and load are reset (`reset`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pagedserve.config import RouterConfig
from pagedserve.core.kv_cache_utils import BlockHash, hash_request_tokens

# vLLM's weighting of waiting against running requests in a replica's load.
WAITING_WEIGHT = 4


class NoReplicaError(RuntimeError):
    """No replica is up (all are dead or restarting, or the one up was excluded)."""


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    matched_blocks: int  # leading prompt blocks the chosen replica's index holds
    affinity: bool  # chosen for its cache (cache_aware), not for its load


class PrefixIndex:
    """The block hashes one replica was sent, least recently sent first, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt's chain the index holds.  Chained hashes make
        the first miss final: a later block's hash covers every block before it."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


@dataclass
class ReplicaLoad:
    in_flight: int = 0  # requests sent to the replica and not ended (exact: counted here)
    sent: int = 0  # requests ever sent to this incarnation of the replica
    reported_waiting: int = 0  # the replica's waiting requests at its last report...
    reported_received: int = 0  # ... when it had received this many

    @property
    def waiting(self) -> int:
        """The reported waiting ones plus those sent that the report had not seen yet."""
        unseen = max(0, self.sent - self.reported_received)
        return min(self.in_flight, self.reported_waiting + unseen)

    @property
    def running(self) -> int:
        return self.in_flight - self.waiting

    @property
    def score(self) -> int:
        return self.waiting * WAITING_WEIGHT + self.running


class Router:
    """Routing state of one front end: a load and a prefix index per replica, and which are up."""

    def __init__(self, config: RouterConfig, num_replicas: int, block_size: int, capacity_blocks: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.config = config
        self.block_size = block_size
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.indexes = [PrefixIndex(capacity_blocks) for _ in range(num_replicas)]
        self.up = [True] * num_replicas
        self._next = 0  # round-robin position, also where load ties start

    @property
    def num_replicas(self) -> int:
        return len(self.loads)

    def block_hashes(self, token_ids: Sequence[int] | None, cache_salt: str | None = None) -> list[BlockHash]:
        """The prompt's chained block hashes, as its replica's prefix cache keys those of a
        request with only a client salt (an adapter's or a LongRoPE prompt's blocks are keyed
        apart there, Request.hash_salt: for them this is affinity only, never a wrong hit)."""
        if not token_ids:
            return []
        return hash_request_tokens(token_ids, self.block_size, cache_salt)

    def choose(self, hashes: Sequence[BlockHash], num_tokens: int,
               exclude: Collection[int] = ()) -> RouteDecision:
        """The replica for a prompt of `num_tokens` tokens whose full blocks hash to
        `hashes`, among those up and not in `exclude` (a retry leaves out the one that
        failed).  Changes nothing: `dispatched` records the choice once it is made."""
        candidates = [i for i in range(self.num_replicas) if self.up[i] and i not in exclude]
        if not candidates:
            raise NoReplicaError("no engine replica is serving right now")
        # Start the scan at the round-robin position, so equal candidates take turns.
        candidates.sort(key=lambda i: (i - self._next) % self.num_replicas)
        policy = self.config.policy
        if policy == "round_robin":
            chosen = candidates[0]
            return RouteDecision(chosen, self.indexes[chosen].match(hashes), affinity=False)
        if policy == "least_loaded":
            chosen = min(candidates, key=lambda i: self.loads[i].score)
            return RouteDecision(chosen, self.indexes[chosen].match(hashes), affinity=False)
        matches = {i: self.indexes[i].match(hashes) for i in candidates}
        if not self._imbalanced(candidates):
            best = max(candidates, key=lambda i: (matches[i], -self.loads[i].score))
            covered = matches[best] * self.block_size
            if matches[best] and covered >= self.config.cache_threshold * num_tokens:
                return RouteDecision(best, matches[best], affinity=True)
        chosen = min(candidates, key=lambda i: (self.loads[i].score, len(self.indexes[i])))
        return RouteDecision(chosen, matches[chosen], affinity=False)

    def _imbalanced(self, candidates: list[int]) -> bool:
        scores = [self.loads[i].score for i in candidates]
        high, low = max(scores), min(scores)
        return (high - low > self.config.balance_abs_threshold
                and high > low * self.config.balance_rel_threshold)

    def dispatched(self, replica: int, hashes: Sequence[BlockHash]) -> None:
        """A request was sent to `replica`: it will cache the prompt's blocks, and it has one
        more request, waiting until its next report says otherwise."""
        self.indexes[replica].insert(hashes)
        load = self.loads[replica]
        load.in_flight += 1
        load.sent += 1
        self._next = (replica + 1) % self.num_replicas

    def ended(self, replica: int) -> None:
        """A request sent to `replica` ended there (finished, aborted, failed or moved)."""
        load = self.loads[replica]
        load.in_flight = max(0, load.in_flight - 1)

    def report(self, replica: int, num_waiting: int, num_received: int) -> None:
        """The replica's own count of waiting requests when it had received `num_received`
        requests in all (requests sent after those still count as waiting)."""
        load = self.loads[replica]
        load.reported_waiting, load.reported_received = num_waiting, num_received

    def set_up(self, replica: int, up: bool) -> None:
        self.up[replica] = up

    def reset(self, replica: int) -> None:
        """The replica restarted: its cache and queues are empty.  The requests sent to it
        before still count until each ends (moved or failed: `ended` is called once for
        each): zeroing them made the count low by as many, as they ended, while new
        requests were in flight."""
        self.indexes[replica].clear()
        self.loads[replica] = ReplicaLoad(in_flight=self.loads[replica].in_flight)
