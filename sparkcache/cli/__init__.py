"""The ``sparkcache`` command: a thin layer over :mod:`sparkcache.admin`.

Each subcommand parses its arguments, calls one admin function and prints the
result: an aligned table for people, or the admin result as JSON with
``--json`` (``log``: one JSON object per request, a line each).  Long commands
(verify, export, import, sweep) draw a progress bar on stderr when stderr is a
terminal or ``--progress`` is given.  Errors print one line on stderr,
``sparkcache: error: <message>`` (with ``--json``, a JSON object: ``error``,
``message``, ``exit_code``), never a traceback (``--debug`` shows it), and the
exit status says what happened (:data:`EXIT_CODES`).

Read-only commands (models, ls, show, stats, log, tenants, check without --fix) and every
``--dry-run`` open the store without upgrading its schema; commands that delete
(clear, rm, sweep, check --fix) can rehearse with ``--dry-run``, and ``clear``
asks first on a terminal.

This module is the entry point: the parser (:func:`build_parser`, the global
options) and :func:`main`, which runs a command and turns its errors into one
line and an exit status.  The commands are in :mod:`sparkcache.cli.commands`
(reading) and :mod:`sparkcache.cli.maintenance` (changing and checking); what
they share (the context, the output helpers, the exit statuses) in
:mod:`sparkcache.cli.output`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn

from sparkcache import admin
from sparkcache.cli.commands import (
    cmd_db_current,
    cmd_db_downgrade,
    cmd_db_upgrade,
    cmd_log,
    cmd_ls,
    cmd_models,
    cmd_serve,
    cmd_shell,
    cmd_show,
    cmd_stats,
    cmd_tenants,
)
from sparkcache.cli.maintenance import (
    cmd_check,
    cmd_clear,
    cmd_export,
    cmd_import,
    cmd_pin,
    cmd_rm,
    cmd_shared_sweep,
    cmd_sweep,
    cmd_upload,
    cmd_verify,
)
from sparkcache.cli.output import (
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_STORE,
    EXIT_USAGE,
    Context,
    Declined,
)
from sparkcache.errors import InvalidArgument, NotFound, SparkCacheError
from sparkcache.serve import launch

__all__ = ["EXIT_CODES", "build_parser", "main"]

EPILOG = "exit codes:\n" + "\n".join(
    textwrap.fill(text, 79, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
    for code, text in EXIT_CODES.items())
FOLDER_HELP = (
    "the store's folder (default: $SPARK_KV_CACHE_FOLDER, else $SPARK_STORAGE/kvcache, else "
    "~/.local/share/spark/kvcache)"
)


# -- the parser -------------------------------------------------------------------------


def _ids(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a snapshot id (an integer)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a snapshot id (ids start at 1)")
    return value


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of requests") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of requests (1 or more)")
    return value


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Options accepted before or after the subcommand (``sparkcache ls --json``).

    The subcommands' copies default to SUPPRESS, so they never overwrite a value
    given before the subcommand.
    """
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("global options (before or after the command)")

    group.add_argument("--folder", metavar="DIR", default=default(None), help=FOLDER_HELP)
    group.add_argument("--storage", metavar="URL", default=default(None),
                        help="where the payloads live when not in the folder (a path or URL);"
                             " recorded when the store is created, and found again without it")
    group.add_argument("--shared", metavar="URL", default=default(None),
                        help="the shared tier (s3://bucket/prefix, file:///path, any fsspec "
                             "URL; default for upload: $SPARK_KV_CACHE_SHARED); checked at "
                             "once, recorded by the store; credentials and endpoint from the "
                             "environment (AWS_*)")
    group.add_argument("--relocate", action="store_true", default=default(False),
                        help="record --storage (or --shared) as the store's storage (or "
                             "shared tier): after moving the payloads there, or to upload "
                             "every snapshot to another tier")
    group.add_argument("--json", action="store_true", default=default(False),
                        help="print the result as JSON (for scripts)")
    group.add_argument("--progress", action=argparse.BooleanOptionalAction,
                        default=default(None),
                        help="draw progress bars on stderr (default: when stderr is a terminal)")
    group.add_argument("--debug", action="store_true", default=default(False),
                        help="show the traceback of an error")


COMMANDS: list[tuple[str, Callable[[Context], int], str]] = [
    ("models", cmd_models, "list models: id, name, digest, snapshots, MB, deleted"),
    ("ls", cmd_ls, "list snapshots (of one model): tokens, MB, use, parent, pin, state"),
    ("show", cmd_show, "one snapshot with its segments, chain, children and leases"),
    ("stats", cmd_stats, "hits, misses, written/restored tokens and bytes, evictions, "
                         "quarantines"),
    ("log", cmd_log, "the requests served: what each found cached, wrote and cost"),
    ("tenants", cmd_tenants, "each tenant of each model: snapshots, MB, requests, hit rate"),
    ("verify", cmd_verify, "re-hash every segment file; quarantine the corrupt ones"),
    ("check", cmd_check, "compare the index with the files and processes (fsck)"),
    ("clear", cmd_clear, "delete every snapshot of a model, or of one tenant (leased ones "
                         "stay)"),
    ("rm", cmd_rm, "delete a model: its snapshots, its row and its folder"),
    ("pin", cmd_pin, "never evict a snapshot"),
    ("unpin", cmd_pin, "let a pinned snapshot be evicted again"),
    ("sweep", cmd_sweep, "run one retention pass (SPARK_KV_CACHE_* limits)"),
    ("export", cmd_export, "copy a model's snapshots, verified, to a folder or URL"),
    ("upload", cmd_upload, "copy the snapshots not uploaded yet to the shared tier, now"),
    ("shared-sweep", cmd_shared_sweep, "apply the shared tier's per-model budget and age "
                                       "(SPARK_KV_CACHE_SHARED_* limits), one host at a time"),
    ("import", cmd_import, "verify and publish the snapshots of an export"),
    ("shell", cmd_shell, "interactive SQLite shell on the index (read-only by default)"),
    ("db", cmd_db_current, "the index's schema: db current, db upgrade, db downgrade"),
]
MODEL_HELP = "model id, name, or 4+ characters of its digest (see `sparkcache models`)"


class UsageError(Exception):
    """A command line argparse refused; main() reports it (as JSON under --json)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse, raising UsageError instead of printing the error and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser: argparse.ArgumentParser = Parser(
        prog="sparkcache", formatter_class=fmt, epilog=EPILOG,
        description="Inspect and maintain a sparkcache KV-cache snapshot store.")
    parser.add_argument("--version", action="version", version=f"sparkcache {admin.VERSION}",
                        help="print the version and exit")
    _global_options(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                 title="commands")
    sub: dict[str, argparse.ArgumentParser] = {}
    for name, func, text in COMMANDS:
        p = subs.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                            parents=[common], formatter_class=fmt, epilog=EPILOG)
        p.set_defaults(func=func)
        sub[name] = p
    _reading_arguments(sub)
    _deleting_arguments(sub)
    _copying_arguments(sub)
    _add_serve(subs, fmt)
    _add_db(sub["db"], common, fmt)
    return parser


def _reading_arguments(sub: dict[str, argparse.ArgumentParser]) -> None:
    """The arguments of the commands that read a store (and of pin, unpin)."""
    sub["ls"].add_argument("model", nargs="?", help=MODEL_HELP + "; default: every model")
    sub["stats"].add_argument("model", nargs="?", help=MODEL_HELP + "; default: every model")
    sub["tenants"].add_argument("model", nargs="?", help=MODEL_HELP + "; default: every model")
    sub["log"].add_argument("--model", help=MODEL_HELP + "; default: every model")
    sub["log"].add_argument("--limit", type=_limit, default=50, metavar="N",
                            help="show the newest N requests (default 50)")
    sub["log"].add_argument("--follow", action="store_true",
                            help="then print new requests as they are logged (every 0.5 s) "
                                 "until Ctrl-C or SIGTERM; with --json, one JSON object per line "
                                 "throughout")
    for name in ("show", "pin", "unpin"):
        sub[name].add_argument("id", type=_ids, help="snapshot id (see `sparkcache ls`)")
    sub["shell"].add_argument("sql", nargs="*", help="SQL or dot-commands to run instead of "
                                                     "the interactive shell")
    sub["shell"].add_argument("--write", action="store_true",
                              help="open the index read-write (bypasses the store's "
                                   "bookkeeping; prefer the admin commands)")


def _deleting_arguments(sub: dict[str, argparse.ArgumentParser]) -> None:
    """The arguments of the commands that check a store or delete from it."""
    sub["verify"].add_argument("--requeue", action="store_true",
                               help="verify the quarantined snapshots instead, and give back "
                                    "those whose files are whole again")
    sub["check"].add_argument("--fix", action="store_true",
                              help="repair what was found (remove dead rows and orphan files)")
    sub["clear"].add_argument("model", help=MODEL_HELP)
    sub["clear"].add_argument("--tenant", metavar="KEY",
                              help="delete only this tenant's snapshots (its prompt_cache_key; "
                                   "see `sparkcache tenants`)")
    sub["clear"].add_argument("--keep-pinned", action="store_true",
                              help="keep pinned snapshots (and their ancestors)")
    sub["clear"].add_argument("--yes", action="store_true",
                              help="do not ask for confirmation (needed without a terminal)")
    sub["rm"].add_argument("model", help=MODEL_HELP)
    for name in ("check", "clear", "rm", "sweep", "shared-sweep"):
        sub[name].add_argument(
            "--dry-run", action="store_true",
            help=("with --fix: " if name == "check" else "")
            + "print what would be deleted (--json: the same report as the real run, with "
              "dry_run, files and folders) and change nothing")
    sweep = sub["sweep"]
    sweep.add_argument("--max-age-hours", type=float, metavar="H",
                       help="override SPARK_KV_CACHE_MAX_AGE_HOURS (0 keeps while there is room)")
    sweep.add_argument("--total-mb", type=int, metavar="MB",
                       help="override SPARK_KV_CACHE_TOTAL_MB (0 = no total limit)")
    sweep.add_argument("--min-free-mb", type=int, metavar="MB",
                       help="override SPARK_KV_CACHE_MIN_FREE_MB")
    shared_sweep = sub["shared-sweep"]
    shared_sweep.add_argument("--mb", type=float, metavar="MB",
                              help="override SPARK_KV_CACHE_SHARED_MB, the most each model "
                                   "may take in the tier (0 = no budget)")
    shared_sweep.add_argument("--max-age-hours", type=float, metavar="H",
                              help="override SPARK_KV_CACHE_SHARED_MAX_AGE_HOURS (else "
                                   "SPARK_KV_CACHE_MAX_AGE_HOURS, 168; 0 keeps)")


def _copying_arguments(sub: dict[str, argparse.ArgumentParser]) -> None:
    """The arguments of the commands that copy snapshots: export, import, upload."""
    sub["export"].add_argument("model", help=MODEL_HELP)
    sub["export"].add_argument("dest", help="an empty folder, or any fsspec URL "
                                            "(memory://x, s3://bucket/path)")
    sub["import"].add_argument("src", help="a folder or URL written by `sparkcache export`")
    sub["upload"].add_argument("--limit", type=_limit, metavar="N",
                               help="look at N snapshots at most (default: all)")


def _add_serve(subs: Any, fmt: type[argparse.HelpFormatter]) -> None:
    """``serve``: its arguments go to the launcher unparsed (:func:`main`); this
    parser is for ``sparkcache --folder DIR serve ...`` and the command list."""
    # No option prefix: every argument after `serve`, --help included, is the launcher's.
    serve = subs.add_parser("serve", add_help=False, prefix_chars="\x01", help=launch.SUMMARY,
                            description=launch.SUMMARY[0].upper() + launch.SUMMARY[1:] + ".",
                            formatter_class=fmt, epilog=launch.EPILOG)
    serve.add_argument("serve_args", nargs=argparse.REMAINDER,
                       help="MODEL, sparkcache's options and vLLM's (sparkcache serve --help)")
    serve.set_defaults(func=cmd_serve)


def _add_db(db: argparse.ArgumentParser, common: argparse.ArgumentParser,
            fmt: type[argparse.HelpFormatter]) -> None:
    """``db``'s actions: current, upgrade, downgrade."""
    db_subs = db.add_subparsers(dest="db_command", metavar="ACTION", required=True,
                                title="actions")
    for name, func, text in (
        ("current", cmd_db_current, "print the index's schema revision and the newest known"),
        ("upgrade", cmd_db_upgrade, "upgrade the index to the newest schema revision"),
        ("downgrade", cmd_db_downgrade, "take the index back to an older schema revision "
                                        "(for an older sparkcache)"),
    ):
        p = db_subs.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                               parents=[common], formatter_class=fmt, epilog=EPILOG)
        p.set_defaults(func=func)
        if name == "downgrade":
            p.add_argument("revision", help="the revision to go back to (see docs/index.md; "
                                            "`sparkcache db current` shows the index's)")


def _error(err: IO[str], message: str, *, as_json: bool = False, kind: str = "Error",
           code: int = EXIT_STORE) -> int:
    """Report an error on stderr, as one line or one JSON object; returns ``code``."""
    message = " ".join(message.split())
    if as_json:
        err.write(json.dumps({"error": kind, "message": message, "exit_code": code}) + "\n")
    else:
        err.write(f"sparkcache: error: {message}\n")
    return code


def _exit_code(exc: Exception) -> int:
    if isinstance(exc, Declined):
        return EXIT_PROBLEMS
    if isinstance(exc, (InvalidArgument, NotFound)):
        return EXIT_USAGE
    return EXIT_STORE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see EXIT_CODES)."""
    out, err, inp = sys.stdout, sys.stderr, sys.stdin
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # every other argument may be vLLM's: no parsing here
        return launch.main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        if "--json" in argv:  # not parsed, but asked for
            return _error(err, exc.message, as_json=True, kind="UsageError", code=EXIT_USAGE)
        exc.parser.print_usage(err)
        err.write(f"{exc.parser.prog}: error: {exc.message}\n")
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    ctx = Context(args, out, err, inp)
    try:
        code: int = args.func(ctx)
        out.flush()
        return code
    except KeyboardInterrupt:
        return _error(err, "interrupted", as_json=args.json, kind="KeyboardInterrupt",
                      code=EXIT_INTERRUPTED)
    except BrokenPipeError:  # `sparkcache ls | head`: the reader left, not an error
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return EXIT_OK
    except Exception as exc:
        if args.debug:
            import traceback

            traceback.print_exc(file=err)
        known = isinstance(exc, (SparkCacheError, OSError, Declined)) or \
            type(exc).__module__ == "apsw"
        message = str(exc) or type(exc).__name__
        if not known:
            message = (f"unexpected {type(exc).__name__}: {exc} (a sparkcache bug; rerun with "
                       "--debug and report the traceback)")
        return _error(err, message, as_json=args.json, kind=type(exc).__name__,
                      code=_exit_code(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
