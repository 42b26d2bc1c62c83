"""The ``sparkcache`` subcommands that change or check a store and its copies:
verify, check, clear, rm, pin, sweep, upload, shared-sweep, export, import.

Each ``cmd_<name>(ctx)`` calls one :mod:`sparkcache.admin` function, as in
:mod:`sparkcache.cli.commands`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sparkcache import admin
from sparkcache.cli.output import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_STORE,
    Context,
    Declined,
    plural,
    table,
)
from sparkcache.errors import InvalidArgument

__all__ = [
    "cmd_check", "cmd_clear", "cmd_export", "cmd_import", "cmd_pin", "cmd_rm",
    "cmd_shared_sweep", "cmd_sweep", "cmd_upload", "cmd_verify",
]


def cmd_verify(ctx: Context) -> int:
    if ctx.args.requeue:
        return _requeue(ctx)
    with ctx.store() as store:
        bar = ctx.bar("verify")
        try:
            report = admin.verify(store, progress=bar)
        finally:
            bar.close()

    def text() -> str:
        head = (f"verified {plural(report.segments, 'segment')} ({admin.mb(report.nbytes)} MB): "
                + ("all intact" if report.clean else
                   f"{len(report.corrupt)} corrupt, quarantined: "
                   + ", ".join(map(str, report.quarantined))))
        if report.clean:
            return head
        return head + "\n" + table(["SNAPSHOT", "RANK", "REASON", "MESSAGE"],
                                   [[p.snapshot_id, p.rank, p.reason, p.message]
                                    for p in report.corrupt])

    ctx.emit(report, text)
    return EXIT_OK if report.clean else EXIT_PROBLEMS


def _requeue(ctx: Context) -> int:
    with ctx.store() as store, ctx.bar("requeue").spin():
        r = admin.requeue(store)

    def text() -> str:
        head = (f"requeued {plural(len(r.requeued), 'snapshot')}"
                + (": " + ", ".join(map(str, r.requeued)) if r.requeued else ""))
        if not r.still_quarantined:
            return head
        return head + "\nstill quarantined:\n" + _problems(r.still_quarantined)

    ctx.emit(r, text)
    return EXIT_OK if not r.still_quarantined else EXIT_PROBLEMS


def _report(result: Any) -> Any:
    """The report of a result that may be a dry run's."""
    return result.report if isinstance(result, admin.DryRun) else result


def _would(dry: bool, done: str, would: str) -> str:
    return would if dry else done


def _dry_note(result: Any) -> str:
    """The last line of a dry run's text: what would go; "" for a real run."""
    if not isinstance(result, admin.DryRun):
        return ""
    return (f"\ndry run: nothing was changed ({plural(len(result.files), 'file')}"
            + (f" and {plural(len(result.folders), 'folder')}" if result.folders else "")
            + " would be deleted)")


def cmd_check(ctx: Context) -> int:
    fix, dry = ctx.args.fix, ctx.args.dry_run
    with ctx.store(upgrade=fix and not dry) as store, ctx.bar("check").spin():
        result = admin.check(store, fix=fix, dry_run=dry)
    report = _report(result)

    def text() -> str:
        if report.clean:
            return "index and files agree: nothing to fix" + _dry_note(result)
        found: list[tuple[str, list[Any]]] = [
            ("expired leases", report.expired_leases),
            ("publishes whose process died (snapshot, rank)", report.dead_publishes),
            ("snapshots stuck pending", report.stuck_pending),
            ("snapshots whose file is missing", report.missing_files),
            ("files no row names", report.orphan_files),
        ]
        lines = [f"{name}: {len(items)}  {', '.join(map(str, items[:10]))}"
                 + (" ..." if len(items) > 10 else "") for name, items in found if items]
        if not fix:
            lines.append("run `sparkcache check --fix` to repair.")
        else:
            lines.append(_would(dry, "fixed.", "--fix would repair all of it."))
        return "\n".join(lines) + _dry_note(result)

    ctx.emit(result, text)
    return EXIT_OK if report.clean else EXIT_PROBLEMS


def cmd_clear(ctx: Context) -> int:
    a = ctx.args
    whose = "the model" if a.tenant is None else "the tenant"
    if not (a.yes or a.dry_run or ctx.interactive):
        raise InvalidArgument(
            f"`sparkcache clear {a.model}` deletes every snapshot of {whose} and there is "
            "no terminal to ask on: pass --yes to go ahead (--dry-run shows what would go)")
    with ctx.store(upgrade=not a.dry_run) as store:
        if not (a.yes or a.dry_run):
            plan = admin.clear_model(store, a.model, keep_pinned=a.keep_pinned,
                                     dry_run=True, tenant=a.tenant).report
            if plan.deleted and not ctx.confirm(
                    f"delete {plural(len(plan.deleted), 'snapshot')} of {_whose(plan)}, "
                    f"{admin.mb(plan.nbytes)} MB?"):
                raise Declined("not confirmed: nothing was deleted")
        with ctx.bar("clear").spin():
            result = admin.clear_model(store, a.model, keep_pinned=a.keep_pinned,
                                       dry_run=a.dry_run, tenant=a.tenant)
    r = _report(result)
    dry = a.dry_run

    def text() -> str:
        lines = [f"{_would(dry, 'deleted', 'would delete')} "
                 f"{plural(len(r.deleted), 'snapshot')} of {_whose(r)}, {admin.mb(r.nbytes)} MB"
                 + (": " + ", ".join(map(str, r.deleted)) if dry and r.deleted else "")]
        if r.kept_leased:
            lines.append(f"{_would(dry, 'kept', 'would keep')} {len(r.kept_leased)} in use "
                         "(leased, or needed by a leased one): "
                         + ", ".join(map(str, r.kept_leased)) + "; clear again later")
        if r.kept_pinned:
            lines.append(f"{_would(dry, 'kept', 'would keep')} pinned: "
                         + ", ".join(map(str, r.kept_pinned)))
        return "\n".join(lines) + _dry_note(result)

    ctx.emit(result, text)
    return EXIT_OK


def _whose(r: admin.ClearReport) -> str:
    """``model (id N)``, or ``tenant T of model (id N)`` (the name escaped)."""
    own = f"{r.model} (id {r.model_id})"
    return own if r.tenant is None else f"tenant {admin.printable(r.tenant)} of {own}"


def cmd_rm(ctx: Context) -> int:
    dry = ctx.args.dry_run
    with ctx.store(upgrade=not dry) as store, ctx.bar("rm").spin():
        result = admin.delete_model(store, ctx.args.model, dry_run=dry)
    r = _report(result)
    ctx.emit(result, lambda: (
        f"{_would(dry, 'deleted', 'would delete')} model {r.model} (id {r.model_id}) and its "
        "folder" if r.complete else
        f"model {r.model} (id {r.model_id}) {_would(dry, 'is', 'would be')} marked deleted; "
        f"{plural(len(r.remaining), 'snapshot')} still leased go when their leases end "
        "(the sweeper finishes the job)") + _dry_note(result))
    return EXIT_OK


def cmd_pin(ctx: Context) -> int:
    with ctx.store() as store:
        row = admin.pin(store, ctx.args.id) if ctx.args.command == "pin" else \
            admin.unpin(store, ctx.args.id)
    ctx.emit(row, lambda: f"snapshot {row.id} {'pinned' if row.pinned else 'unpinned'}")
    return EXIT_OK


def cmd_sweep(ctx: Context) -> int:
    overrides = {k: v for k, v in (("max_age_hours", ctx.args.max_age_hours),
                                   ("total_mb", ctx.args.total_mb),
                                   ("min_free_mb", ctx.args.min_free_mb)) if v is not None}
    settings = admin.retention_settings(ctx.folder, **overrides)
    dry = ctx.args.dry_run
    with ctx.store(upgrade=not dry) as store, ctx.bar("sweep").spin():
        result = admin.sweep(store, settings, dry_run=dry)
    r = _report(result)

    def text() -> str:
        if not r.count and not r.folders_removed:
            return "nothing to sweep" + _dry_note(result)
        lines = [f"{_would(dry, 'evicted', 'would evict')} {n} ({reason})"
                 for reason, n in r.counts().items()]
        if r.models_removed:
            lines.append(_would(dry, "models removed: ", "models that would be removed: ")
                         + ", ".join(r.models_removed))
        if r.folders_removed:
            lines.append(_would(dry, "folders removed: ", "folders that would be removed: ")
                         + str(len(r.folders_removed)))
        return "\n".join(lines) + _dry_note(result)

    ctx.emit(result, text)
    return EXIT_OK


def cmd_upload(ctx: Context) -> int:
    """``sparkcache upload``: one synchronous pass of the uploader (exit 1 when some
    were refused, 3 when the tier failed: what is left goes on the next pass)."""
    if ctx.shared is None:
        raise InvalidArgument("no shared tier: pass --shared URL or set SPARK_KV_CACHE_SHARED")
    with ctx.store(tier=True) as store, ctx.bar("upload").spin():
        r = admin.upload(store, limit=ctx.args.limit)

    def text() -> str:
        lines = [f"uploaded {plural(len(r.uploaded), 'snapshot')} "
                 f"({plural(r.objects_put, 'object')}, {admin.mb(r.bytes_put)} MB), "
                 f"{len(r.present)} already in the tier, {r.pending} left"]
        if r.refused:
            lines.append(table(["SNAPSHOT", "REASON"],
                               [[x.snapshot_id, x.reason] for x in r.refused]))
        if r.error:
            failed = f"{plural(len(r.failed), 'snapshot')} failed" if r.failed else "failed"
            lines.append(f"{failed}; the first: {r.error}")
        return "\n".join(lines)

    ctx.emit(r, text)
    if r.error:
        return EXIT_STORE
    return EXIT_PROBLEMS if r.refused else EXIT_OK


def cmd_shared_sweep(ctx: Context) -> int:
    """``sparkcache shared-sweep``: one sweep of the shared tier (``--shared``, else
    SPARK_KV_CACHE_SHARED); exit 1 when another host holds the sweep."""
    if ctx.shared is None:
        raise InvalidArgument("no shared tier: pass --shared URL or set SPARK_KV_CACHE_SHARED")
    limits = admin.TierLimits.from_env(mb=ctx.args.mb, max_age_hours=ctx.args.max_age_hours)
    dry = ctx.args.dry_run
    with ctx.bar("shared-sweep").spin():
        r = admin.shared_sweep(ctx.shared, limits, dry_run=dry)

    def text() -> str:
        if not r.swept:
            return f"skipped: {r.skipped}"
        note = " (dry run: nothing was changed)" if dry else ""
        kept = f"{plural(r.kept, 'snapshot')} kept ({admin.mb(r.kept_bytes)} MB)"
        if not r.count and not r.objects_deleted:
            return f"nothing to sweep in {r.url}: {kept}{note}"
        lines = [f"{_would(dry, 'deleted', 'would delete')} {n} ({reason})"
                 for reason, n in r.counts().items()]
        lines.append(f"{_would(dry, 'objects deleted: ', 'objects that would be deleted: ')}"
                     f"{r.objects_deleted} ({admin.mb(r.bytes_freed)} MB), aliases "
                     f"{_would(dry, 'renamed', 'to rename')}: {r.aliases_rewritten}; {kept}")
        return "\n".join(lines) + note

    ctx.emit(r, text)
    return EXIT_OK if r.swept else EXIT_PROBLEMS


def _problems(items: Sequence[admin.Problem]) -> str:
    return table(["SNAPSHOT", "RANK", "REASON", "MESSAGE"],
                 [[p.snapshot_id, p.rank, p.reason, p.message] for p in items])


def cmd_export(ctx: Context) -> int:
    with ctx.store() as store:
        bar = ctx.bar("export")
        try:
            r = admin.export_model(store, ctx.args.model, ctx.args.dest, progress=bar)
        finally:
            bar.close()
    ctx.emit(r, lambda: (
        f"exported {plural(len(r.snapshots), 'snapshot')} of {r.model} "
        f"({plural(r.segments, 'file')}, "
        f"{admin.mb(r.nbytes)} MB) to {r.dest}"
        + (f"\nleft out {len(r.skipped)}:\n{_problems(r.skipped)}" if r.skipped else "")))
    return EXIT_PROBLEMS if r.skipped else EXIT_OK


def cmd_import(ctx: Context) -> int:
    bar = ctx.bar("import")
    try:  # import_into creates the store, and removes it again if nothing was imported
        r = admin.import_into(ctx.folder, ctx.args.src, storage=ctx.args.storage, progress=bar)
    finally:
        bar.close()
    ctx.emit(r, lambda: (
        f"imported {plural(len(r.imported), 'snapshot')} of {r.model} ({admin.mb(r.nbytes)} MB, "
        f"{sum(i.deduplicated for i in r.imported)} already present)"
        + (f"\nrefused {len(r.refused)}:\n{_problems(r.refused)}" if r.refused else "")))
    return EXIT_PROBLEMS if r.refused else EXIT_OK
