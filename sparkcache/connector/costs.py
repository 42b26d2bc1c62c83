"""The cost model: restore a match, restore a shorter prefix, or recompute it.

:class:`CostModel` holds measured rates: the engine's prefill (seconds per
token, by prompt-length bucket, from its own steps), a step's fixed time, and
the restore rate of each source (seconds per byte and a fixed latency: local
disk warm and cold, the verification, each shared tier endpoint).  Each new
measurement is averaged in with weight :data:`WEIGHT` (an exponential moving
average: recent ones weigh more).  :class:`CostPlanner` makes each request's
choice from them (the mechanism: docs/connector.md, "Restore or recompute"):

* the local match is restored when its expected restore time is below the
  prefill time of the same tokens, else recomputed (``too_slow``);
* the shared tier is asked only when fetching what it may add, then
  restoring it, is expected to be faster than recomputing it, and within the
  deadline; else the local part alone is restored (``partial``) or nothing;
* a source never measured is tried (bounded by the deadline for the tier);
  a source found too slow is measured again now and then
  (:data:`REPROBE_SECONDS`): the tier by a fetch in the background, the
  local disk by one restore, so a recovered source is used again.

Rates live in the index (:mod:`sparkcache.measures`) so a restarted engine
starts with what the last one learned.  Pure Python: unit-tested without vLLM.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from sparkcache.errors import SparkCacheError
from sparkcache.measures import CostRow
from sparkcache.periodic import Periodic
from sparkcache.store import SnapshotStore

__all__ = ["LOAD_KEY", "PREFILL", "STEP", "VERIFY", "WARM_SECONDS", "WEIGHT", "CostKeeper",
           "CostModel", "CostPlanner", "Rate", "StepClock", "bucket_of", "tier_source"]

logger = logging.getLogger("vllm.sparkcache")

#: A new measurement's weight in its rate's average.
WEIGHT = 0.3
PREFILL, STEP, LOCAL_WARM, LOCAL_COLD, VERIFY = (
    "prefill", "step", "local_warm", "local_cold", "verify")
#: A snapshot written or read this recently is taken to be in the page cache.
WARM_SECONDS = 600.0
#: A tier found too slow is probed again after this, doubling while it stays slow.
REPROBE_SECONDS = (30.0, 600.0)
#: Steps that prefill fewer tokens are not measured (their time is mostly overhead).
MIN_PREFILL_TOKENS = 16
#: The stats key prefix of a worker's per-request restore time (seconds, summed
#: over the ranks): how the scheduler learns the local restore rates.
LOAD_KEY = "\x01load\x00"
#: Loads planned and not yet measured, at most (the oldest are forgotten).
MAX_PLANNED = 1024
#: How often what was learned is written to the index.
SAVE_SECONDS = 10.0


def bucket_of(tokens: int) -> int:
    """A prompt length's bucket: ``ceil(log2(tokens))`` (0 for 1 token or none)."""
    return max(0, math.ceil(math.log2(tokens))) if tokens > 1 else 0


def tier_source(url: str, endpoint: str | None) -> str:
    """The source name of a shared tier: its URL and endpoint (never credentials)."""
    return f"tier {url} {endpoint or '-'}"


@dataclass
class Rate:
    """``latency_s`` + units x ``unit_s`` seconds; ``samples`` measurements so far."""

    unit_s: float
    latency_s: float = 0.0
    samples: int = 0
    updated_at: float = 0.0

    def seconds(self, units: float) -> float:
        return self.latency_s + max(0.0, units) * self.unit_s


def _mix(old: float, new: float) -> float:
    """``new`` averaged into ``old`` (0: nothing measured yet, ``new`` is taken)."""
    return new if old == 0 else old + WEIGHT * (new - old)


class CostModel:
    """Measured rates, thread-safe.  ``model``: the engine's identity digest (its
    prefill rows); ``clock``: wall seconds (the rows' ``updated_at``)."""

    def __init__(self, model: str, *, clock: Callable[[], float] = time.time) -> None:
        self.model = model
        self.clock = clock
        self._rates: dict[tuple[str, int], Rate] = {}
        self._dirty: set[tuple[str, int]] = set()
        #: Decayed sums (weight, x, y, xx, xy) of the fitted sources' samples.
        self._fits: dict[tuple[str, int], list[float]] = {}
        self._lock = threading.Lock()

    # -- inputs ------------------------------------------------------------------------

    def load(self, rows: Iterable[CostRow]) -> None:
        """Start from kept rows (this engine's model's and the host's)."""
        with self._lock:
            for row in rows:
                if row.model in ("", self.model):
                    self._rates[(row.source, row.bucket)] = Rate(
                        row.unit_s, row.latency_s, row.samples, row.updated_at)

    def set(self, source: str, unit_s: float, latency_s: float = 0.0, bucket: int = 0) -> None:
        """Give a rate outright (what a measurement made elsewhere found)."""
        with self._lock:
            self._rates[(source, bucket)] = Rate(unit_s, latency_s, 1, self.clock())
            self._dirty.add((source, bucket))

    def observe(self, source: str, units: float, seconds: float, bucket: int = 0, *,
                fit: bool = False) -> None:
        """A use of ``source`` that moved ``units`` (bytes, tokens) in ``seconds``;
        its known latency is taken off before the rate is averaged in.  ``fit``:
        both the rate and the latency come from a line fitted through the
        samples (:meth:`_fit`), for a source with no other latency measurement."""
        if units <= 0 or seconds < 0:
            return
        with self._lock:
            key = (source, bucket)
            rate = self._rates.setdefault(key, Rate(0.0))
            if fit:
                self._fit(key, rate, units, seconds)
            else:
                rate.unit_s = _mix(rate.unit_s, max(0.0, seconds - rate.latency_s) / units)
            self._touch(rate, key)

    def _fit(self, key: tuple[str, int], rate: Rate, x: float, y: float) -> None:
        """Least squares of seconds on units over the samples, each older one
        weighing ``1 - WEIGHT`` less: a fixed time per use (threads, a lease)
        apart from the per-unit rate, once samples of different sizes came."""
        sums = self._fits.setdefault(key, [0.0] * 5)
        for i, value in enumerate((1.0, x, y, x * x, x * y)):
            sums[i] = sums[i] * (1 - WEIGHT) + value
        n, sx, sy, sxx, sxy = sums
        spread = n * sxx - sx * sx
        slope = (n * sxy - sx * sy) / spread if spread > 1e-6 * n * sxx else -1.0
        if slope > 0 and sy - slope * sx >= 0:
            rate.unit_s, rate.latency_s = slope, (sy - slope * sx) / n
        else:  # one size so far (or noise): the latency known, the rate averaged
            rate.unit_s = max(0.0, sy / n - rate.latency_s) / (sx / n)

    def observe_latency(self, source: str, seconds: float) -> None:
        """A use of ``source`` that moved nothing (a tier's miss): its fixed time."""
        with self._lock:
            rate = self._rates.setdefault((source, 0), Rate(0.0))
            rate.latency_s = _mix(rate.latency_s, max(0.0, seconds))
            self._touch(rate, (source, 0))

    def observe_bound(self, source: str, units: float, seconds: float) -> None:
        """``source`` did not move ``units`` within ``seconds`` (a missed deadline):
        its rate is at most that, whatever was measured before."""
        if units <= 0:
            return
        with self._lock:
            rate = self._rates.setdefault((source, 0), Rate(0.0))
            bound = max(0.0, seconds - rate.latency_s) / units
            # Rounded up until ``units`` take ``seconds`` at least: rounded down,
            # the same fetch is expected within the deadline it just missed.
            while rate.latency_s + units * bound < seconds:
                bound = math.nextafter(bound, math.inf)
            rate.unit_s = max(rate.unit_s, bound)
            self._touch(rate, (source, 0))

    def observe_step(self, prefill: int, longest: int, seconds: float) -> None:
        """A step of the engine: ``prefill`` prompt tokens computed (0: decodes
        only), the longest ending at ``longest``, in ``seconds``."""
        if prefill == 0:
            self.observe_latency(STEP, seconds)
        elif prefill >= MIN_PREFILL_TOKENS:
            overhead = self.rate(STEP)
            own = seconds - (overhead.latency_s if overhead is not None else 0.0)
            self.observe(PREFILL, prefill, max(own, seconds / 2), bucket_of(longest))

    def _touch(self, rate: Rate, key: tuple[str, int]) -> None:
        rate.samples += 1
        rate.updated_at = self.clock()
        self._dirty.add(key)

    def measure_verification(self, nbytes: int = 8 << 20) -> None:
        """Time the digest every restored byte goes through (xxh3_128) on this CPU."""
        data = bytes(nbytes)
        started = time.perf_counter()
        xxhash.xxh3_128_digest(data)
        self.observe(VERIFY, nbytes, time.perf_counter() - started)

    # -- outputs -----------------------------------------------------------------------

    def rate(self, source: str, bucket: int = 0) -> Rate | None:
        """The rate of ``source`` (None: never measured)."""
        with self._lock:
            rate = self._rates.get((source, bucket))
            return None if rate is None or rate.samples == 0 else Rate(**vars(rate))

    def prefill_seconds(self, tokens: int, prompt_tokens: int) -> float | None:
        """Expected seconds to compute ``tokens`` of a ``prompt_tokens`` prompt, at
        the rate of its length's bucket (else the nearest measured one); None:
        no prefill measured yet."""
        want = bucket_of(prompt_tokens)
        with self._lock:
            known = [b for (s, b), r in self._rates.items() if s == PREFILL and r.samples]
            if not known:
                return None
            near = min(known, key=lambda b: (abs(b - want), -b))
            return tokens * self._rates[(PREFILL, near)].unit_s

    def restore_seconds(self, source: str, nbytes: float) -> float | None:
        """Expected seconds to restore ``nbytes`` from ``source`` (None: never measured)."""
        rate = self.rate(source)
        return None if rate is None else rate.seconds(nbytes)

    def rows(self, *, changed: bool = False) -> list[CostRow]:
        """The rates as index rows (``changed``: only those changed since the last
        such call); a prefill or step row is the model's, the rest the host's."""
        with self._lock:
            keys = sorted(self._dirty if changed else self._rates)
            if changed:
                self._dirty = set()
            return [CostRow(self.model if s in (PREFILL, STEP) else "", s, b, r.unit_s,
                            r.latency_s, r.samples, r.updated_at)
                    for (s, b) in keys if (r := self._rates[(s, b)]).samples]


@dataclass
class Planned:
    """A restore the scheduler planned: its source and bytes per rank."""

    source: str
    nbytes: int
    fresh: bool = False  # a probe of a source found slow: its time replaces the rate


class CostPlanner:
    """Each request's choice (see the module docstring) and the measurements of
    the restores it planned.  ``store``: reads a snapshot's times (warm or
    cold); ``bytes_per_token``: KV bytes of one token on one rank;
    ``ranks``: the workers whose restore times the stats sum."""

    def __init__(self, model: CostModel, store: Any, *, bytes_per_token: float,
                 ranks: int = 1, tier: str | None = None, deadline: float = math.inf) -> None:
        self.model, self.store = model, store
        self.bytes_per_token, self.ranks = bytes_per_token, max(1, ranks)
        #: The shared tier's source name (None: no tier) and its deadline.
        self.tier, self.deadline = tier, deadline
        self._planned: OrderedDict[str, Planned] = OrderedDict()
        #: Sources found too slow: (monotonic time of the next probe, the interval).
        self._probes: dict[str, tuple[float, float]] = {}
        self._probing = False  # the next fetch result is a probe's: it replaces the rate
        self._warmed: set[str] = set()  # local sources whose first restore was not measured
        #: Snapshots read into the page cache at the engine's start, and when.
        self._read_ahead: tuple[frozenset[int], float] = (frozenset(), 0.0)
        self._lock = threading.Lock()

    def warmed(self, snapshots: frozenset[int]) -> None:
        """These snapshots were just read into the page cache (the engine's
        start, :mod:`sparkcache.connector.warming`): warm for
        :data:`WARM_SECONDS`, as if restored now.  Called from another thread."""
        self._read_ahead = (frozenset(snapshots), self.model.clock())

    def _source(self, snapshot_id: int) -> str:
        try:
            info = self.store.snapshot(snapshot_id)
        except Exception:  # gone or unreadable: the restore finds out; assume cold
            return LOCAL_COLD
        used = max(info.created_at, info.last_used)
        read_ahead, at = self._read_ahead
        if snapshot_id in read_ahead:
            used = max(used, at)
        return LOCAL_WARM if self.model.clock() - used < WARM_SECONDS else LOCAL_COLD

    def tier_pays(self, have: int, limit: int, prompt_tokens: int) -> bool:
        """Whether fetching the prompt's ``[have, limit)`` from the tier and
        restoring it is expected to beat recomputing it (an unmeasured tier: yes)."""
        if self.tier is None:
            return True
        nbytes = (limit - have) * self.bytes_per_token
        fetch = self.model.restore_seconds(self.tier, nbytes)
        compute = self.model.prefill_seconds(limit - have, prompt_tokens)
        if fetch is None or compute is None:
            return True  # tried once, bounded by the deadline
        fetch += self.model.restore_seconds(LOCAL_WARM, nbytes) or 0.0
        if fetch < min(compute, self.deadline):
            with self._lock:
                self._probes.pop(self.tier, None)
            return True
        return False

    def probe_due(self, source: str | None = None) -> bool:
        """Whether ``source`` (default: the tier), found too slow, is due to be
        measured again: first :data:`REPROBE_SECONDS` after it was found so, then
        after doubling intervals; True at most once per interval."""
        source = self.tier if source is None else source
        if source is None:
            return False
        now = time.monotonic()
        with self._lock:
            due, every = self._probes.get(source, (0.0, 0.0))
            if not every:
                self._probes[source] = (now + REPROBE_SECONDS[0], REPROBE_SECONDS[0])
                return False
            if now < due:
                return False
            every = min(REPROBE_SECONDS[1], every * 2)
            self._probes[source] = (now + every, every)
            self._probing = self._probing or source == self.tier
            return True

    def choose(self, req_id: str, snapshot_id: int, local: int, claim: int,
               prompt_tokens: int) -> bool:
        """Whether restoring ``[local, claim)`` of snapshot ``snapshot_id`` beats
        recomputing it (a source or prefill never measured: it is tried).  A
        restore chosen is remembered, to be measured when it lands."""
        source = self._source(snapshot_id)
        nbytes = int((claim - local) * self.bytes_per_token)
        restore = self.model.restore_seconds(source, nbytes)
        compute = self.model.prefill_seconds(claim - local, prompt_tokens)
        fresh = False
        if restore is not None and compute is not None and restore >= compute:
            if not self.probe_due(source):
                return False
            fresh = True  # restored anyway now and then: its time replaces the rate
        with self._lock:
            if not fresh:
                self._probes.pop(source, None)
            self._planned[req_id] = Planned(source, nbytes, fresh)
            while len(self._planned) > MAX_PLANNED:
                self._planned.popitem(last=False)
        return True

    def loads_measured(self, data: dict[str, Any] | None) -> None:
        """The workers' restore times in a step's stats (:data:`LOAD_KEY`)."""
        for key, seconds in (data or {}).items():
            if not key.startswith(LOAD_KEY):
                continue
            with self._lock:
                planned = self._planned.pop(key[len(LOAD_KEY):], None)
                # An engine's first restore from a source also pays one-time
                # set-up (threads, buffers, first touches): not a measurement.
                first = planned is not None and planned.source not in self._warmed
                if planned is not None:
                    self._warmed.add(planned.source)
            if planned is None or (first and not planned.fresh):
                continue
            seconds /= self.ranks
            if planned.fresh:
                self.model.set(planned.source, seconds / max(1, planned.nbytes))
            else:
                self.model.observe(planned.source, planned.nbytes, seconds, fit=True)

    def fetched(self, nbytes: int, seconds: float) -> None:
        """A fetch from the tier ended: ``nbytes`` downloaded in ``seconds``."""
        if self.tier is None:
            return
        with self._lock:
            fresh, self._probing = self._probing, False
        if fresh:  # a probe of a tier found slow: what it finds now replaces the rate
            old = self.model.rate(self.tier)
            latency = old.latency_s if old is not None and nbytes else seconds
            self.model.set(self.tier, max(0.0, seconds - latency) / nbytes if nbytes else 0.0,
                           latency)
        elif nbytes:
            self.model.observe(self.tier, nbytes, seconds)
        else:
            self.model.observe_latency(self.tier, seconds)

    def fetch_expired(self, have: int, limit: int) -> None:
        """A request stopped waiting for the tier at the deadline: the tier moves
        less than the prompt's ``[have, limit)`` in that time."""
        if self.tier is not None:
            self.model.observe_bound(self.tier, (limit - have) * self.bytes_per_token,
                                     self.deadline)


class StepClock:
    """Times the engine's steps for the prefill rate: from the plan of a step
    (``build_connector_meta``) to its output (``update_connector_output``).
    A step with a restore read under its forward is not a prefill measurement."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self._pending: tuple[float, int, int] | None = None  # (started, prefill, longest)

    def planned(self, step: tuple[int, int] | None, *, in_step_loads: bool) -> None:
        """A step was planned: ``(prompt tokens it computes (0: decodes only), the
        longest prompt's end)``; None: it computes nothing (not measured)."""
        self._pending = None if step is None or in_step_loads else (time.perf_counter(), *step)

    def ended(self) -> None:
        """The planned step's output came back: measured."""
        if self._pending is not None:
            started, prefill, longest = self._pending
            self._pending = None
            self.model.observe_step(prefill, longest, time.perf_counter() - started)


class CostKeeper:
    """Keeps a :class:`CostModel` in the index (``costs``): read now; measured
    for the verification, then the changed rates written every
    :data:`SAVE_SECONDS`, by a thread on an index connection of its own
    (``folder``'s), and once more at :meth:`close`."""

    def __init__(self, model: CostModel, folder: str | Any) -> None:
        self.model = model
        self.store = SnapshotStore(folder)
        try:
            model.load(self.store.costs(model.model))
        except SparkCacheError as exc:  # learned again
            logger.warning("sparkcache: the kept cost model could not be read: %s", exc)
        self._first = True
        self._periodic = Periodic(self._save, SAVE_SECONDS, name="sparkcache-costs").start()

    def _save(self) -> None:
        if self._first:
            self._first = False
            self.model.measure_verification()
        rows = self.model.rows(changed=True)
        if rows:
            self.store.record_costs(rows)

    def close(self) -> None:
        """Stop the thread, write what changed, close the index connection."""
        self._periodic.stop(timeout=10)
        try:
            self._save()
        except SparkCacheError as exc:
            logger.warning("sparkcache: the cost model was not kept: %s", exc)
        self.store.close()
