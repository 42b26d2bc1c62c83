"""sparkcache.serve.launch: the vLLM command line and environment ``sparkcache serve``
becomes, built without vLLM; the options it refuses say what to do instead."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkcache.errors import InvalidArgument
from sparkcache.serve import launch
from sparkcache.serve.launch import MIDDLEWARE, build

SERVER = "vllm.entrypoints.openai.api_server"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment whose default store is in tmp_path (nothing of the caller's)."""
    return {"SPARK_STORAGE": str(tmp_path / "spark"), "PATH": "/usr/bin"}


def option(argv: list[str], name: str) -> str:
    """The value after ``name`` (which must occur exactly once)."""
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def transfer(argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(option(argv, "--kv-transfer-config"))
    return out


def test_the_command_is_vllms_server_with_the_connector(env: dict[str, str],
                                                        tmp_path: Path) -> None:
    cmd = build(["/models/tiny"], env, cuda=True)
    assert cmd.argv[:3] == [sys.executable, "-m", SERVER]
    assert option(cmd.argv, "--model") == "/models/tiny"
    assert option(cmd.argv, "--host") == "127.0.0.1"
    assert "--enable-prompt-tokens-details" in cmd.argv
    assert option(cmd.argv, "--middleware") == MIDDLEWARE
    assert MIDDLEWARE == "sparkcache.serve.middleware.SparkCacheMiddleware"
    folder = str(tmp_path / "spark" / "kvcache")
    assert transfer(cmd.argv) == {
        "kv_connector": "SparkCacheConnector",
        "kv_connector_module_path": "sparkcache.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"folder": folder},
    }
    assert "--enforce-eager" not in cmd.argv  # CUDA: vLLM's default (graphs)
    assert option(cmd.argv, "--shutdown-timeout") == "30"  # saves in flight finish
    given = build(["/models/tiny", "--shutdown-timeout", "5"], env, cuda=True)
    assert option(given.argv, "--shutdown-timeout") == "5"
    assert cmd.env["SPARKCACHE_SERVE_FOLDER"] == folder
    assert "SPARKCACHE_ADMIN_TOKEN" not in cmd.env
    assert "SPARK_KV_CACHE_LOG_ROWS" not in cmd.env
    assert cmd.env["PATH"] == "/usr/bin"  # the rest of the environment is kept
    assert env == {"SPARK_STORAGE": str(tmp_path / "spark"), "PATH": "/usr/bin"}


def test_the_middleware_the_command_names_exists() -> None:
    module, _, name = MIDDLEWARE.rpartition(".")
    spec = importlib.util.find_spec(module)  # found, not imported (that imports vLLM)
    assert spec is not None and spec.origin is not None
    assert re.search(rf"^class {name}\b", Path(spec.origin).read_text(), re.MULTILINE)


def test_an_explicit_host_is_kept(env: dict[str, str]) -> None:
    cmd = build(["m", "--host", "0.0.0.0"], env, cuda=True)
    assert option(cmd.argv, "--host") == "0.0.0.0"
    cmd = build(["m", "--host=::"], env, cuda=True)
    assert option(cmd.argv, "--host") == "::"


def test_options_sparkcache_does_not_know_go_to_vllm_in_order(env: dict[str, str]) -> None:
    vllm = ["--port", "8123", "--max-model-len=4096", "--served-model-name", "tiny",
            "--seed", "-1", "--api-key", "k", "--trust-remote-code"]
    cmd = build(["m", *vllm[:4], "--folder", "/tmp/x", *vllm[4:]], env, cuda=True)
    assert cmd.argv[-len(vllm):] == vllm
    assert "--folder" not in cmd.argv


def test_without_cuda_vllm_runs_eager(env: dict[str, str]) -> None:
    cmd = build(["m"], env, cuda=False)
    assert cmd.argv.count("--enforce-eager") == 1
    cmd = build(["m", "--enforce-eager"], env, cuda=False)
    assert cmd.argv.count("--enforce-eager") == 1
    assert cmd.argv[-1] == "--enforce-eager"  # the user's own, where it was given
    cmd = build(["m", "--no-enforce-eager"], env, cuda=False)
    assert "--enforce-eager" not in cmd.argv
    assert "--no-enforce-eager" in cmd.argv
    for spelling in ("--enforce_eager", "--no_enforce_eager", "--enforce-eager=true"):
        cmd = build(["m", spelling], env, cuda=False)
        assert "--enforce-eager" not in cmd.argv[:-1], spelling
        assert cmd.argv[-1] == spelling


def test_folder_comes_from_the_option_then_the_environment(env: dict[str, str],
                                                            tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.chdir(tmp_path)
    cmd = build(["m", "--folder", "rel/store"], env, cuda=True)
    assert cmd.env["SPARKCACHE_SERVE_FOLDER"] == str(tmp_path / "rel" / "store")
    assert transfer(cmd.argv)["kv_connector_extra_config"]["folder"] == \
        str(tmp_path / "rel" / "store")
    cmd = build(["m"], {**env, "SPARK_KV_CACHE_FOLDER": "from-env"}, cuda=True)
    assert cmd.env["SPARKCACHE_SERVE_FOLDER"] == str(tmp_path / "from-env")
    assert Path(cmd.env["SPARKCACHE_SERVE_FOLDER"]).is_absolute()


def test_connector_config_joins_the_folder(env: dict[str, str], tmp_path: Path) -> None:
    extra = {"load_async": "auto", "min_tokens": 32}
    cmd = build(["m", "--folder", str(tmp_path / "s"), "--connector-config",
                 json.dumps(extra)], env, cuda=True)
    assert transfer(cmd.argv)["kv_connector_extra_config"] == {
        **extra, "folder": str(tmp_path / "s")}


def test_admin_token_and_log_rows_go_to_the_environment(env: dict[str, str]) -> None:
    cmd = build(["m", "--admin-token", "s3cret", "--log-rows", "500"], env, cuda=True)
    assert cmd.env["SPARKCACHE_ADMIN_TOKEN"] == "s3cret"
    assert cmd.env["SPARK_KV_CACHE_LOG_ROWS"] == "500"
    assert "s3cret" not in " ".join(cmd.argv)  # not in the process list
    cmd = build(["m"], {**env, "SPARKCACHE_ADMIN_TOKEN": "from-env"}, cuda=True)
    assert cmd.env["SPARKCACHE_ADMIN_TOKEN"] == "from-env"
    cmd = build(["m", "--admin-token", "given"], {**env, "SPARKCACHE_ADMIN_TOKEN": "env"},
                cuda=True)
    assert cmd.env["SPARKCACHE_ADMIN_TOKEN"] == "given"


@pytest.mark.parametrize(("argv", "fragment"), [
    (["m", "--kv-transfer-config", "{}"], "use --connector-config"),
    (["m", "--kv-transfer-config={}"], "sets --kv-transfer-config itself"),
    (["m", "--middleware", "x.Y"], "sets --middleware itself"),
    (["m", "--middleware=x.Y"], "run vLLM directly"),
    # vLLM reads "_" as "-", one field after ".", and abbreviations.
    (["m", "--kv_transfer_config", "{}"], "sets --kv-transfer-config itself"),
    (["m", "--kv-transfer-config.kv_connector=X"], "sets --kv-transfer-config itself"),
    (["m", "--kv-transfer-conf", "{}"], "sets --kv-transfer-config itself"),
    (["m", "--middle", "x.Y"], "sets --middleware itself"),
    (["m", "--model", "other"], "sparkcache serve MODEL"),
    (["m", "--model=other"], "first argument"),
    (["m", "--connector-config", "{load_async: auto}"], "--connector-config is not JSON"),
    (["m", "--connector-config", "[1, 2]"], "must be a JSON object"),
    (["m", "--connector-config", '{"folder": "/x"}'], "give 'folder' as --folder"),
    (["m", "--connector-config", '{"log_rows": 5}'], "--log-rows"),
    (["m", "--log-rows", "0"], "--log-rows must be at least 1"),
    (["m", "--log-rows", "-3"], "--log-rows must be at least 1"),
], ids=["transfer", "transfer=", "middleware", "middleware=", "transfer_", "transfer.",
        "transfer-abbreviated", "middleware-abbreviated", "model", "model=",
        "bad-json", "not-object", "folder", "log-rows-in-config", "log-rows-0",
        "log-rows-negative"])
def test_refused_options_say_what_to_do(env: dict[str, str], argv: list[str],
                                        fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        build(argv, env, cuda=True)
    assert fragment in str(info.value)


def test_a_log_turned_off_in_the_environment_is_refused(env: dict[str, str]) -> None:
    """Usage of a streamed answer is read from the log: with none, every stream would
    wait for facts that never come."""
    with pytest.raises(InvalidArgument, match=r"SPARK_KV_CACHE_LOG_ROWS=0 .* --log-rows N"):
        build(["m"], {**env, "SPARK_KV_CACHE_LOG_ROWS": "0"}, cuda=True)
    with pytest.raises(InvalidArgument, match="SPARK_KV_CACHE_LOG_ROWS='lots' is not valid"):
        build(["m"], {**env, "SPARK_KV_CACHE_LOG_ROWS": "lots"}, cuda=True)
    cmd = build(["m", "--log-rows", "5"], {**env, "SPARK_KV_CACHE_LOG_ROWS": "0"}, cuda=True)
    assert cmd.env["SPARK_KV_CACHE_LOG_ROWS"] == "5"
    cmd = build(["m"], {**env, "SPARK_KV_CACHE_LOG_ROWS": "7"}, cuda=True)
    assert cmd.env["SPARK_KV_CACHE_LOG_ROWS"] == "7"


def test_main_reports_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(["m", "--middleware", "x.Y"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparkcache serve: error: sparkcache serve sets --middleware")


def test_main_without_a_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main([]) == 2
    assert "the following arguments are required: MODEL" in capsys.readouterr().err


def test_help_says_where_vllms_options_are(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sparkcache serve MODEL [options] [vLLM options]")
    assert "python -m vllm.entrypoints.openai.api_server --help" in out
    for name in ("--folder", "--host", "--admin-token", "--log-rows", "--connector-config"):
        assert name in out
    assert "--python" not in out


def test_serve_help_from_the_command_line(tmp_path: Path) -> None:
    """The CLI hands `serve` to the launcher before its own parsing; no vLLM is started."""
    done = subprocess.run([sys.executable, "-m", "sparkcache", "serve", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: sparkcache serve MODEL")
    assert "python -m vllm.entrypoints.openai.api_server --help" in done.stdout
    listed = subprocess.run([sys.executable, "-m", "sparkcache", "--help"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^\s+serve\s", listed.stdout, re.MULTILINE), listed.stdout
