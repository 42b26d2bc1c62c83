"""Each request's facts for the request log and the usage report.

The planners note what they did (:class:`Facts`); :class:`Reporter` hands a
request's row (``requestlog.LOG_FIELDS``) to ``on_facts`` when its prompt
has been scheduled and again when it finished (docs/connector.md, "What the
connector reports of each request").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Facts", "NewPrefix", "Reporter", "ttl_key"]

logger = logging.getLogger("vllm.sparkcache")


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


def ttl_key(seconds: float | None) -> str:
    """A keep time as ``written_by_ttl`` names it: whole seconds as text ("0": none)."""
    return str(int(seconds or 0))


@dataclass(frozen=True)
class NewPrefix:
    """A breakpoint snapshot a request saves, restoring ``[0, n)`` (to the last
    breakpoint: exactly when the snapshot holds its block, ``Saves._pieces``),
    of which ``before`` tokens were stored already; ``marks`` are its
    breakpoints' (end, keep seconds or None), ascending: the tokens up to each
    end (above the previous one) are that breakpoint's."""

    n: int
    before: int
    marks: tuple[tuple[int, float | None], ...] = ()

    def split(self, lo: int, by_ttl: dict[str, int]) -> None:
        """Add the tokens ``[lo, n)`` to ``by_ttl``, each to its breakpoint's keep
        time (what no breakpoint ends above goes to the last one's)."""
        for end, keep in self.marks:
            hi = min(end, self.n)
            if hi > lo:
                by_ttl[ttl_key(keep)] = by_ttl.get(ttl_key(keep), 0) + hi - lo
                lo = hi
        if self.n > lo:
            last = ttl_key(self.marks[-1][1] if self.marks else None)
            by_ttl[last] = by_ttl.get(last, 0) + self.n - lo


@dataclass
class Facts:
    """What the log and usage say of one request (wall-clock times)."""

    log_id: str | None = None  # the request's own name for the log
    breakpoints: tuple[int, ...] = ()
    local: int | None = None  # vLLM's own prefix hit at the last admission
    restored: int = 0  # tokens a planned restore supplies
    remote_restored: int = 0  # of ``restored``, those the tier supplied
    #: The cost model's choice: 'restored', 'partial', 'too_slow' (None: none made).
    restore_reason: str | None = None
    new_prefixes: list[NewPrefix] = field(default_factory=list)
    admitted_at: float | None = None
    loaded_at: float | None = None  # an asynchronous restore landed
    first_token_at: float | None = None
    reported: bool = False  # the prefill's facts went out

    def saw_output(self, request: Any, now: float) -> None:
        """Note ``now`` as the first output token's time, if it is the first seen."""
        if self.first_token_at is None and \
                len(request.all_token_ids) > int(request.num_prompt_tokens):
            self.first_token_at = now

    def row(self, request: Any, *, final: bool) -> dict[str, Any]:
        """The request's row of the request log (``requestlog.LOG_FIELDS``).

        ``written_tokens`` counts the tokens its breakpoint saves add to the
        store beyond what it read (vLLM's own hit and the restore) and what
        was stored before: a breakpoint already stored adds none.
        ``written_by_ttl`` splits them by the keep time of the breakpoint each
        belongs to (:class:`NewPrefix`), in whole seconds as text ("300",
        "3600"; "0" for a breakpoint without one), summing to ``written_tokens``.
        """
        arrival = float(getattr(request, "arrival_time", 0.0) or 0.0) or None
        covered = (self.local or 0) + self.restored
        by_ttl: dict[str, int] = {}
        for prefix in sorted(self.new_prefixes, key=lambda p: (p.n, p.before)):
            prefix.split(max(covered, prefix.before), by_ttl)
            covered = max(covered, prefix.n)
        written = sum(by_ttl.values())
        row: dict[str, Any] = {
            "request_id": self.log_id or str(request.request_id),
            "created_at": arrival,
            "prompt_tokens": int(request.num_prompt_tokens),
            "live_tokens": self.local,
            "restored_tokens": self.restored,
            "remote_tokens": self.remote_restored,
            "written_tokens": written,
            "written_by_ttl": by_ttl,
            "breakpoints": list(self.breakpoints),
            "queue_s": _since(arrival, self.admitted_at),
            "restore_s": _since(self.admitted_at, self.loaded_at),
            "restore_reason": self.restore_reason,
        }
        if final:
            row["output_tokens"] = max(0, len(request.all_token_ids)
                                       - int(request.num_prompt_tokens))
            row["ttft_s"] = _since(arrival, self.first_token_at)
        return row


class Reporter:
    """Hands rows to ``on_facts``; a failing callback is logged, never raised."""

    def __init__(self, on_facts: Callable[[dict[str, Any]], None] | None) -> None:
        self.on_facts = on_facts

    def stepped(self, request: Any, facts: Facts, step: int) -> None:
        """A step computes ``step`` tokens of the request: the prefill's facts
        are reported once, in the step that schedules the prompt's end."""
        if not facts.reported and int(request.num_computed_tokens) + step >= \
                int(request.num_prompt_tokens):
            facts.reported = True
            self.report(request, facts, final=False)

    def finished(self, request: Any, facts: Facts) -> dict[str, Any]:
        """The final row, reported; what ``request_finished`` returns to vLLM."""
        facts.saw_output(request, time.time())
        return self.report(request, facts, final=True)

    def report(self, request: Any, facts: Facts, *, final: bool) -> dict[str, Any]:
        row = facts.row(request, final=final)
        if self.on_facts is not None:
            try:
                self.on_facts(row)
            except Exception as exc:  # the log is never worth a failed step
                logger.warning("sparkcache: request log: %s", exc)
        return row
