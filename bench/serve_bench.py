"""``sparkcache serve`` against plain vLLM's server: multi-turn chats across a restart.

    .venv/bin/python bench/serve_bench.py [--quick] [--repeats N] [--blocks N]
                                          [--server-args ARGS] [--cache DIR] [--json]
                                          [--openai-explicit] [--sparkcache-args ARGS]

A random-weight Llama (:data:`sparkcache.demo.model.DEMO`: prefilling 2000
tokens takes a second or two on two cores), built once into ``--cache`` and
reused.  K conversations (6 x 3 turns; ``--quick``: 3 x 2) share one system
prompt of ~1500 tokens, marked ``cache_control: {"type": "ephemeral"}``, and
have distinct ~200-token user turns; turn i's messages are the earlier turns,
their answers and a new user turn (greedy: ``temperature`` 0, max_tokens 16).
The conversations take turns round-robin, and the KV cache holds a little
more than one conversation (``--num-gpu-blocks-override``), so a conversation
has been pushed out of vLLM's live cache by the others when it comes back.
After half of the requests the server is stopped and a new one started on the
same options (and, for sparkcache, the same store folder); the rest follow.

The same requests go to both servers, one after the other (never at once;
``--repeats`` alternates which goes first, each repeat on a new store):

* sparkcache: ``python -m sparkcache serve MODEL --folder STORE ...``;
* plain vLLM: ``python -m vllm.entrypoints.openai.api_server --model MODEL
  --enable-prompt-tokens-details ...`` (it ignores ``cache_control``);

both with ``--dtype float32 --block-size 32 --enforce-eager --seed 0``, the same
``--max-model-len``, ``--num-gpu-blocks-override`` and ``--max-num-seqs``, and
the same environment (vLLM's CPU settings, its OpenMP threads bound to the same
cores), plus ``--server-args`` (and ``--sparkcache-args``, sparkcache's alone).
A server is stopped as Ctrl-C stops it (SIGINT to its process group).  Each
server answers one unrelated warm-up request before it is measured (the first
request of a process compiles helpers).

Requests go through the official ``anthropic`` client, streamed: TTFT is the
client's time from sending to the first text delta (to the end of the answer
when it has no text); a request's time runs to the end of its stream.  The
table shows, per server, TTFT p50/p90/max over the requests before and after
the restart, the sum of the request times, and the usage the client received
(``input_tokens``, ``cache_read_input_tokens``, ``cache_creation_input_tokens``;
plain vLLM's cache_read is its own prefix cache and its cache_creation the
whole blocks it computed into it, so "computed" = input + cache_creation is
the column to compare), then the ratios sparkcache / plain measured in this
run (STYLE habit 10).  Server start-up times are shown but not in the totals.
Exit status 1 when a server fails to start, dies or answers with an error;
nothing is written but a temporary folder (removed) and the model cache.

``--openai-explicit`` measures instead what OpenAI's explicit breakpoints cost
a request: the same conversations (no restart) go to one ``sparkcache
serve`` as streamed chat completions through the official ``openai`` client,
once plainly and once with the system prompt's text part marked
``prompt_cache_breakpoint: {"mode": "explicit"}`` under
``prompt_cache_options: {"mode": "explicit"}``, each pass on a new server and
store (``--repeats`` alternates which goes first); TTFT is the time to the
first content delta.  The table shows both passes' TTFT p50/p90 and the
usage (``cached_tokens``, ``cache_write_tokens``), then the ratio with /
without (the target: at most 1.05x).  docs/benchmarks.md has the results.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import anthropic
import openai
from anthropic.types import MessageParam, TextBlockParam
from common import grid, log, machine, pct

from sparkcache.demo.engine import ENGINE_ENV
from sparkcache.demo.model import DEMO, WORDS, ModelSize, ensure_model

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "bench"
BLOCK_SIZE = 32  # vLLM on CPU: a multiple of 32
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
SERVERS = ("sparkcache", "plain vLLM")
PHASES = ("before restart", "after restart")


@dataclass(frozen=True)
class Plan:
    """Everything that sizes a run."""

    size: ModelSize = DEMO
    conversations: int = 6
    turns: int = 3
    system_tokens: int = 1500
    user_tokens: int = 200
    max_tokens: int = 16
    #: Prompt tokens allowed per assistant answer as the client sends it back (a
    #: random model's text re-tokenizes to more tokens than it was generated as).
    answer_allowance: int = 64


FULL = Plan()
QUICK = replace(FULL, conversations=3, turns=2)


@dataclass
class Turn:
    """One measured request, as the client saw it."""

    server: str
    phase: str
    conversation: int
    turn: int
    ttft_s: float
    total_s: float
    input_tokens: int
    cache_read: int
    cache_creation: int
    output_tokens: int
    text: bool  # the answer had text (else TTFT is the end of the answer)


@dataclass
class Run:
    """One server's pass over the conversations (with its restart)."""

    server: str
    turns: list[Turn] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)  # each process's start-up


# -- texts -----------------------------------------------------------------------------


def text_of(n_tokens: int, seed: int, count: Callable[[str], int], lead: str = "") -> str:
    """Deterministic pseudo-English of at least ``n_tokens`` tokens (``count``
    counts a text's tokens), sentences of the words the tokenizer learned."""
    rng = random.Random(seed)
    text = lead
    while count(text) < n_tokens:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        text += (" " if text else "") + " ".join(words).capitalize() + rng.choice(".?!")
    return text


@dataclass(frozen=True)
class Workload:
    """The texts sent and the vLLM sizes that fit them."""

    system: str
    users: list[list[str]]  # users[conversation][turn]
    max_model_len: int
    blocks: int


def workload(plan: Plan, model: Path, blocks: int | None) -> Workload:
    tokenizers: Any = importlib.import_module("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    system = text_of(plan.system_tokens, 7, count,
                     "You are the help desk of the river garden library. Answer from these "
                     "notes only, briefly.")
    users = [[text_of(plan.user_tokens, 1000 * c + t, count, f"Question {t + 1} of reader {c + 1}:")
              for t in range(plan.turns)] for c in range(plan.conversations)]
    # The longest prompt (+ the template's few tokens per message) and its answer.
    longest = (count(system) + max(sum(count(u) for u in us) for us in users)
               + (plan.turns - 1) * plan.answer_allowance + 8 * (2 * plan.turns + 1)
               + plan.max_tokens)
    max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    # The longest request's blocks, vLLM's null block and one more: the live cache
    # holds the shared system prompt and about one conversation.
    return Workload(system, users, max_model_len, blocks or max_model_len // BLOCK_SIZE + 2)


# -- servers ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerFailed(RuntimeError):
    """A server did not start, died, or answered with an error."""


class Server:
    """One API server process in a session of its own (so that stopping it stops
    vLLM's engine core and workers too); its output goes to ``log_path``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path,
                 port: int) -> None:
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it and wait for ``/health``; returns the seconds that took."""
        started = time.perf_counter()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with status {self.proc.returncode}")
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return time.perf_counter() - started
            time.sleep(0.5)
        raise ServerFailed(f"{self.name} did not answer /health in {START_TIMEOUT_S:.0f} s")

    def check(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise ServerFailed(f"{self.name} is not running")

    def stop(self) -> None:
        """SIGINT to the process group (vLLM shuts its engine down), SIGKILL after 60 s;
        then SIGKILL whatever is left in the group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def server_command(kind: str, model: Path, store: Path, port: int, wl: Workload,
                   extra: Sequence[str] = ()) -> list[str]:
    common = ["--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", "float32",
              "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--seed", "0",
              "--max-model-len", str(wl.max_model_len),
              "--num-gpu-blocks-override", str(wl.blocks), "--max-num-seqs", "4", *extra]
    if kind == "sparkcache":
        return [sys.executable, "-m", "sparkcache", "serve", str(model),
                "--folder", str(store), *common]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--enable-prompt-tokens-details", *common]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in ENGINE_ENV.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@contextlib.contextmanager
def running(server: Server) -> Iterator[float]:
    """The server, started (yields its start-up seconds) and always stopped."""
    try:
        yield server.start()
    except BaseException:
        tail = server.log_tail()
        server.stop()
        print(f"--- end of {server.log_path} ---\n{tail}", file=sys.stderr)
        raise
    server.stop()


# -- requests --------------------------------------------------------------------------


def ask(client: anthropic.Anthropic, system: str, messages: list[MessageParam],
        max_tokens: int, mark: bool = True) -> tuple[float, float, Any, bool]:
    """One streamed request: (TTFT, total seconds, final message, had text)."""
    block: TextBlockParam = {"type": "text", "text": system}
    if mark:
        block["cache_control"] = {"type": "ephemeral"}
    first = None
    started = time.perf_counter()
    with client.messages.stream(model=SERVED_NAME, max_tokens=max_tokens, system=[block],
                                messages=messages,
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            if (first is None and event.type == "content_block_delta"
                    and event.delta.type == "text_delta" and event.delta.text):
                first = time.perf_counter()
        final = stream.get_final_message()
    ended = time.perf_counter()
    return (first or ended) - started, ended - started, final, first is not None


def warm_up(client: anthropic.Anthropic) -> None:
    """One short request sharing no block with the workload."""
    ask(client, "Warm up.", [{"role": "user", "content": "Say something short."}], 4,
        mark=False)


def replay(kind: str, model: Path, work: Path, plan: Plan, wl: Workload, tag: str,
           extra: Sequence[str]) -> Run:
    """Every conversation round-robin against ``kind``'s server, restarted halfway."""
    run = Run(kind)
    store = work / f"store-{tag}"
    order = [(c, t) for t in range(plan.turns) for c in range(plan.conversations)]
    halves = (order[:len(order) // 2], order[len(order) // 2:])
    history: list[list[MessageParam]] = [[] for _ in range(plan.conversations)]
    for phase, requests in zip(PHASES, halves, strict=True):
        port = free_port()
        server = Server(f"{kind} ({phase})", server_command(kind, model, store, port, wl, extra),
                        server_env(), work / f"{tag}-{kind.replace(' ', '-')}.log", port)
        log(f"{kind}: starting the server ({phase})")
        with running(server) as start_s:
            run.start_s.append(start_s)
            client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                         timeout=REQUEST_TIMEOUT_S)
            try:
                warm_up(client)
                for c, t in requests:
                    messages: list[MessageParam] = [
                        *history[c], {"role": "user", "content": wl.users[c][t]}]
                    ttft, total, final, had_text = ask(client, wl.system, messages,
                                                       plan.max_tokens)
                    answer = "".join(b.text for b in final.content if b.type == "text")
                    history[c] = [*messages, {"role": "assistant", "content": answer or "ok"}]
                    u = final.usage
                    run.turns.append(Turn(kind, phase, c, t, ttft, total, u.input_tokens,
                                          u.cache_read_input_tokens or 0,
                                          u.cache_creation_input_tokens or 0, u.output_tokens,
                                          had_text))
                    log(f"{kind}: conversation {c + 1} turn {t + 1}: TTFT {ttft:.2f} s, "
                        f"prompt {u.input_tokens} + read {u.cache_read_input_tokens or 0} + "
                        f"written {u.cache_creation_input_tokens or 0}")
            except anthropic.APIError as exc:
                server.check()
                raise ServerFailed(f"{server.name} answered with an error: {exc}") from exc
            except OSError as exc:
                raise ServerFailed(f"{server.name}: {exc}") from exc
    return run


# -- OpenAI explicit breakpoints ---------------------------------------------------------

OPENAI_PASSES = ("without breakpoints", "with breakpoints")


def ask_openai(client: Any, system: str, messages: list[Any], max_tokens: int,
               mark: bool) -> tuple[float, Any]:
    """One streamed chat completion: (TTFT, the usage chunk's usage)."""
    part: dict[str, Any] = {"type": "text", "text": system}
    extra: dict[str, Any] = {}
    if mark:
        part["prompt_cache_breakpoint"] = {"mode": "explicit"}
        extra["prompt_cache_options"] = {"mode": "explicit"}
    started = time.perf_counter()
    first, usage = None, None
    for chunk in client.chat.completions.create(
            model=SERVED_NAME, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": [part]}, *messages], **extra):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        usage = chunk.usage or usage
    return (first or time.perf_counter()) - started, usage


def openai_pass(mark: bool, model: Path, work: Path, plan: Plan, wl: Workload, tag: str,
                extra: Sequence[str]) -> list[tuple[float, int, int]]:
    """Every conversation round-robin on a new server: (TTFT, cached, written) each."""
    name = OPENAI_PASSES[mark]
    port = free_port()
    server = Server(name, server_command("sparkcache", model, work / f"store-{tag}", port, wl,
                                         extra), server_env(), work / f"{tag}.log", port)
    out: list[tuple[float, int, int]] = []
    history: list[list[Any]] = [[] for _ in range(plan.conversations)]
    with running(server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        try:
            ask_openai(client, "Warm up.", [{"role": "user", "content": "Say it."}], 4, False)
            for t in range(plan.turns):
                for c in range(plan.conversations):
                    messages = [*history[c], {"role": "user", "content": wl.users[c][t]}]
                    ttft, usage = ask_openai(client, wl.system, messages, plan.max_tokens, mark)
                    history[c] = [*messages, {"role": "assistant", "content": "ok"}]
                    details = usage.prompt_tokens_details
                    out.append((ttft, details.cached_tokens or 0,
                                details.cache_write_tokens or 0))
                    log(f"{name}: conversation {c + 1} turn {t + 1}: TTFT {ttft:.2f} s, "
                        f"cached {out[-1][1]}, written {out[-1][2]}")
        except openai.APIError as exc:
            server.check()
            raise ServerFailed(f"{server.name} answered with an error: {exc}") from exc
    return out


def openai_report(passes: dict[bool, list[tuple[float, int, int]]]) -> str:
    body = []
    for mark in (False, True):
        ttft = [t for t, _, _ in passes[mark]]
        body.append([OPENAI_PASSES[mark], str(len(ttft)), f"{pct(ttft, 50):.2f}",
                     f"{pct(ttft, 90):.2f}", f"{sum(c for _, c, _ in passes[mark])}",
                     f"{sum(w for _, _, w in passes[mark])}"])
    ratio = pct([t for t, _, _ in passes[True]], 50) / pct([t for t, _, _ in passes[False]], 50)
    return (grid(["requests", "n", "TTFT p50 s", "p90 s", "cached_tokens",
                   "cache_write_tokens"], body)
            + f"\n\nwith / without breakpoints: TTFT p50 {ratio:.2f}x (target <= 1.05x)")


def openai_main(plan: Plan, model: Path, wl: Workload, repeats: int,
                extra: Sequence[str]) -> int:
    """``--openai-explicit``: both passes ``repeats`` times, then the table."""
    work = Path(tempfile.mkdtemp(prefix="sparkcache-serve-bench-"))
    passes: dict[bool, list[tuple[float, int, int]]] = {False: [], True: []}
    try:
        for rep in range(repeats):
            for mark in ((False, True) if rep % 2 == 0 else (True, False)):
                passes[mark] += openai_pass(mark, model, work, plan, wl, f"r{rep}-{mark}", extra)
    except ServerFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key, value in machine().items():
        print(f"{key}: {value}")
    print(f"model: random-weight Llama, {plan.size.describe()}; {plan.conversations} "
          f"conversations x {plan.turns} turns, system prompt >= {plan.system_tokens} tokens, "
          f"{repeats} repeat(s)\n")
    print(openai_report(passes))
    return 0


# -- the table -------------------------------------------------------------------------


def summary(turns: Sequence[Turn]) -> dict[str, float]:
    ttft = [t.ttft_s for t in turns]
    return {"n": len(turns), "p50": pct(ttft, 50), "p90": pct(ttft, 90), "max": max(ttft),
            "requests_s": sum(t.total_s for t in turns),
            "prompt": sum(t.input_tokens + t.cache_read + t.cache_creation for t in turns),
            "input": sum(t.input_tokens for t in turns),
            "cache_read": sum(t.cache_read for t in turns),
            "cache_creation": sum(t.cache_creation for t in turns)}


def report(runs: list[Run]) -> tuple[str, dict[str, dict[str, dict[str, float]]]]:
    stats: dict[str, dict[str, dict[str, float]]] = {}
    body = []
    for server in SERVERS:
        turns = [t for r in runs if r.server == server for t in r.turns]
        stats[server] = {}
        for i, phase in enumerate((*PHASES, "all")):
            mine = [t for t in turns if phase in ("all", t.phase)]
            s = stats[server][phase] = summary(mine)
            starts = [r.start_s[i] for r in runs if r.server == server and i < len(r.start_s)]
            body.append([server, phase, f"{s['n']:.0f}", f"{s['p50']:.2f}", f"{s['p90']:.2f}",
                         f"{s['max']:.2f}", f"{s['requests_s']:.1f}", f"{s['prompt']:.0f}",
                         f"{s['cache_read']:.0f}", f"{s['input'] + s['cache_creation']:.0f}",
                         f"{s['input']:.0f}", f"{s['cache_creation']:.0f}",
                         f"{max(starts):.0f}" if starts else ""])
    head = ["server", "requests", "n", "TTFT p50 s", "p90 s", "max s", "requests s",
            "prompt tokens", "cache_read", "computed", "input", "cache_creation", "start s"]
    out = grid(head, body)
    ours, plain = stats[SERVERS[0]], stats[SERVERS[1]]
    ratios = ", ".join(f"{phase} {ours[phase]['p50'] / plain[phase]['p50']:.2f}x"
                       for phase in (*PHASES, "all"))
    out += (f"\n\nsparkcache / plain vLLM: TTFT p50 {ratios}; requests' total time "
            f"{ours['all']['requests_s'] / plain['all']['requests_s']:.2f}x "
            f"({ours['all']['requests_s']:.1f} s vs {plain['all']['requests_s']:.1f} s)")
    no_text = sum(not t.text for r in runs for t in r.turns)
    if no_text:
        out += f"\n{no_text} answer(s) had no text: their TTFT is the end of the answer"
    out += ("\ncomputed = input + cache_creation (plain vLLM counts as cache_creation the whole "
            "blocks it computed into its prefix cache); start s: that server process's start-up "
            "(the slowest of the repeats), not in the requests' time")
    return out, stats


# -- main ------------------------------------------------------------------------------


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every server's stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="sparkcache serve against plain vLLM's server: multi-turn chats with a "
                    "restart, TTFT and usage through the anthropic client (docs/benchmarks.md)")
    parser.add_argument("--quick", action="store_true",
                        help="3 conversations x 2 turns instead of 6 x 3 (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="passes over both servers, alternating which goes first, each "
                        "on a new store (default 2; --quick: 1)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="vLLM's KV cache in blocks of 32 tokens (default: one longest "
                        "conversation and a block)")
    parser.add_argument("--server-args", default="", metavar="ARGS",
                        help="more vLLM options for both servers, as one string "
                        "(e.g. --server-args='--shutdown-timeout 30')")
    parser.add_argument("--sparkcache-args", default="", metavar="ARGS",
                        help="more options for sparkcache serve alone, as one string")
    parser.add_argument("--cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "sparkcache-bench-model",
                        help="where the random model is built once and reused "
                        "(default: %(default)s)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (plan, machine, every request) instead of the table")
    parser.add_argument("--openai-explicit", action="store_true",
                        help="instead: TTFT of OpenAI chat completions with explicit "
                        "breakpoints against without, on sparkcache serve alone")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    plan = QUICK if args.quick else FULL
    extra = shlex.split(args.server_args)
    ours = [*extra, *shlex.split(args.sparkcache_args)]
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    model = args.cache / "model-demo"
    log(f"model in {model} ({'built' if ensure_model(model, plan.size) else 'reused'})")
    wl = workload(plan, model, args.blocks)
    if args.openai_explicit:
        return openai_main(plan, model, wl, args.repeats, ours)
    work = Path(tempfile.mkdtemp(prefix="sparkcache-serve-bench-"))
    runs: list[Run] = []
    try:
        for rep in range(args.repeats):
            order = SERVERS if rep % 2 == 0 else SERVERS[::-1]
            for kind in order:
                runs.append(replay(kind, model, work, plan, wl, f"r{rep}",
                                   ours if kind == "sparkcache" else extra))
    except ServerFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - started
    text, stats = report(runs)
    info = machine()
    info["load average"] = f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after (1-minute)"
    command = shlex.join([".venv/bin/python", "bench/serve_bench.py",
                          *(argv if argv is not None else sys.argv[1:])])
    sizes = {"model": plan.size.describe(), "system prompt tokens": plan.system_tokens,
             "user turn tokens": plan.user_tokens, "max_model_len": wl.max_model_len,
             "kv blocks": wl.blocks, "server args": extra, "sparkcache args": ours}
    if args.json:
        print(json.dumps({"machine": info, "command": command, "seconds": round(elapsed, 1),
                          "plan": {**asdict(plan), **sizes}, "stats": stats,
                          "starts": [[r.server, r.start_s] for r in runs],
                          "turns": [asdict(t) for r in runs for t in r.turns]}, indent=1))
        return 0
    for key, value in info.items():
        print(f"{key}: {value}")
    print(f"command: {command}  ({elapsed:.0f} s)")
    print(f"model: random-weight Llama, {plan.size.describe()}; "
          f"{plan.conversations} conversations x {plan.turns} turns round-robin, one system "
          f"prompt of >= {plan.system_tokens} tokens (cache_control), user turns >= "
          f"{plan.user_tokens} tokens, max_tokens {plan.max_tokens}, temperature 0; "
          f"--max-model-len {wl.max_model_len}, --num-gpu-blocks-override {wl.blocks} "
          f"(blocks of {BLOCK_SIZE}); restart after {plan.conversations * plan.turns // 2} of "
          f"{plan.conversations * plan.turns} requests; {args.repeats} repeat(s)"
          + (f"; both servers also {shlex.join(extra)}" if extra else "")
          + (f"; sparkcache {shlex.join(ours)}" if args.sparkcache_args else "") + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
