"""Cache-miss diagnostics' pure rules: fingerprints, the comparison, each API's form."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest
from anthropic.types import Message
from anthropic.types.beta import BetaDiagnostics
from openai.types.responses import Response

from sparkcache.errors import SparkCacheError
from sparkcache.serve.checks import Refused
from sparkcache.serve.diagnostics import (
    MAX_PARTS,
    Editor,
    Plan,
    Verdict,
    anthropic_form,
    compare,
    fingerprint,
    missed,
    openai_form,
    plan,
    probe_body,
    resolve,
)


def msgs(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny", "max_tokens": 8, "system": "you are terse",
        "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "hello"}],
        "diagnostics": {"previous_message_id": None}}
    body.update(over)
    return body


def resp(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "instructions": "be terse", "input": "hello"}
    body.update(over)
    return body


@pytest.mark.parametrize(("change", "reason", "index"), [
    ({"model": "other"}, "model_changed", -1),
    ({"tools": []}, "tools_changed", -1),
    ({"system": "you are verbose"}, "system_changed", -1),
    ({"messages": [{"role": "user", "content": "hullo"}]}, "messages_changed", 0),
    ({"tool_choice": {"type": "any"}}, "unavailable", -1),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "unavailable", -1),
])
def test_each_anthropic_reason_is_the_first_part_that_differs(
        change: dict[str, Any], reason: str, index: int) -> None:
    before = fingerprint("messages", msgs())
    assert compare("messages", before, fingerprint("messages", msgs(**change))) == \
        Verdict(reason, index)


def test_a_grown_conversation_and_a_moved_mark_are_no_divergence() -> None:
    first = msgs(system=[{"type": "text", "text": "you are terse"}])
    marked = {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}
    grown = msgs(messages=[{"role": "user", "content": [marked]},
                           {"role": "assistant", "content": "hi"},
                           {"role": "user", "content": "more"}])
    assert compare("messages", fingerprint("messages", first),
                   fingerprint("messages", grown)) == Verdict(None)
    # The model, system and tools first: a changed system wins over changed messages.
    both = msgs(system="x", messages=[{"role": "user", "content": "y"}])
    assert compare("messages", fingerprint("messages", msgs()),
                   fingerprint("messages", both)).reason == "system_changed"


def test_a_later_message_that_differs_names_its_index() -> None:
    three = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]
    edited = [three[0], {"role": "assistant", "content": "B"}, three[2]]
    verdict = compare("messages", fingerprint("messages", msgs(messages=three)),
                      fingerprint("messages", msgs(messages=edited)))
    assert verdict == Verdict("messages_changed", 1)
    # Fewer messages than before: the first one missing is the one that differs.
    assert compare("messages", fingerprint("messages", msgs(messages=three)),
                   fingerprint("messages", msgs(messages=three[:1]))) == \
        Verdict("messages_changed", 1)


@pytest.mark.parametrize(("change", "reason", "index"), [
    ({"model": "other"}, "model_changed", -1),
    ({"prompt_cache_key": "k2"}, "prompt_cache_key_changed", -1),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools_changed", -1),
    ({"text": {"format": {"type": "json_object"}}}, "text_format_changed", -1),
    ({"reasoning": {"effort": "high"}}, "reasoning_effort_changed", -1),
    ({"text": {"verbosity": "high"}}, "verbosity_changed", -1),
    ({"service_tier": "flex"}, "service_tier_changed", -1),
    ({"instructions": "be verbose"}, "input_changed", -1),
    ({"input": "hullo"}, "input_changed", 0),
    ({"previous_response_id": "resp_x"}, "unavailable", -1),
])
def test_each_responses_reason(change: dict[str, Any], reason: str, index: int) -> None:
    assert compare("responses", fingerprint("responses", resp()),
                   fingerprint("responses", resp(**change))) == Verdict(reason, index)


def test_responses_input_as_a_string_is_one_user_message() -> None:
    listed = resp(input=[{"role": "user", "content": "hello"},
                         {"role": "user", "content": "more"}])
    assert compare("responses", fingerprint("responses", resp()),
                   fingerprint("responses", listed)) == Verdict(None)
    assert fingerprint("responses", resp(service_tier="auto")) == fingerprint("responses", resp())


def test_a_fingerprint_holds_digests_only_and_is_bounded() -> None:
    secret = "the secret system prompt"
    many = [{"role": "user", "content": f"m{i}"} for i in range(MAX_PARTS + 50)]
    print_ = fingerprint("messages", msgs(system=secret, messages=many))
    text = json.dumps(print_)
    assert secret not in text and "m1" not in text
    assert len(print_["parts"]) == MAX_PARTS
    # A change beyond the kept digests still shows, at the last one.
    changed = [*many[:-1], {"role": "user", "content": "other"}]
    assert compare("messages", print_, fingerprint("messages", msgs(system=secret,
                                                                    messages=changed))) == \
        Verdict("messages_changed", MAX_PARTS - 1)
    assert compare("messages", {**print_, "v": 0}, print_) == Verdict("unavailable")


def test_the_probe_keeps_the_parts_before_and_the_header_of_the_one_that_differs() -> None:
    body = msgs(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert probe_body("messages", body, 1)["messages"] == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]
    assert probe_body("messages", body, 0)["messages"] == [{"role": "user", "content": ""}]
    assert probe_body("messages", body, -1) is None
    assert probe_body("responses", resp(), 0)["input"] == [{"role": "user", "content": ""}]
    assert probe_body("responses", resp(input=[{"type": "function_call_output"}]), 0) is None


def test_missed_tokens_are_the_previous_prompt_beyond_the_shared_ones() -> None:
    assert missed(100, 30) == 70
    assert missed(100, 0) == 100
    assert missed(20, 30) == 0


def test_the_anthropic_form_parses_into_the_sdk_types() -> None:
    assert anthropic_form(Verdict(None), 100, 0) is None
    form = anthropic_form(Verdict("system_changed"), 100, 0)
    assert BetaDiagnostics.model_validate(form).model_dump() == {
        "cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 100}}
    for kind in ("not_found", "unavailable"):
        reason = BetaDiagnostics.model_validate(anthropic_form(Verdict(kind), 9, 0))
        assert reason.cache_miss_reason is not None
        assert reason.cache_miss_reason.type == (
            "previous_message_not_found" if kind == "not_found" else "unavailable")
        assert not hasattr(reason.cache_miss_reason, "cache_missed_input_tokens")


def _response(diagnostics: dict[str, Any]) -> Response:
    return Response.model_validate({
        "id": "resp_1", "created_at": 0, "model": "tiny", "object": "response", "output": [],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "prompt_cache_diagnostics": diagnostics})


def test_the_openai_form_parses_into_the_sdk_types() -> None:
    miss = _response(openai_form(Verdict("input_changed", 2), 120, 50)).prompt_cache_diagnostics
    assert miss is not None and miss.model_dump() == {
        "type": "cache_miss", "reason": "input_changed", "cache_missed_tokens": 70,
        "comparison_reusable_tokens": 120}
    for verdict, kind in ((Verdict(None), "cache_hit"),
                          (Verdict("not_found"), "comparison_response_not_found"),
                          (Verdict("unavailable"), "unavailable")):
        found = _response(openai_form(verdict, 1, 0)).prompt_cache_diagnostics
        assert found is not None and found.type == kind


def test_plan_checks_the_fields_and_names_the_answer() -> None:
    body = msgs()
    made = plan("messages", body, "abc")
    assert made is not None and made.answer_id == "msg_abc" and made.asked
    assert made.previous is None
    assert plan("messages", msgs(diagnostics=None), "abc") is None
    with pytest.raises(Refused) as bad:
        plan("messages", msgs(diagnostics={"previous_message_id": 5}), "abc")
    assert bad.value.param == "diagnostics.previous_message_id"
    with pytest.raises(Refused):
        plan("messages", msgs(diagnostics=[]), "abc")
    with pytest.raises(Refused) as long:
        plan("responses", resp(prompt_cache_options={"comparison_response_id": "r" * 257}), "x")
    assert long.value.param == "prompt_cache_options.comparison_response_id"
    body = resp()
    made = plan("responses", body, "abc")
    assert made is not None and made.answer_id == body["request_id"] == "resp_abc"
    assert not made.asked
    assert plan("chat", {"messages": []}, "abc") is None


@dataclass
class Row:
    api: str | None
    fingerprint: str | None
    prompt_tokens: int | None
    tenant: str | None = None


def _resolved(body: dict[str, Any], row: Any, *, log_on: bool = True,
              render: dict[str, list[int]] | None = None, api: str = "messages",
              tenant: str | None = None) -> Any:
    made = plan(api, body, "new")
    assert made is not None

    async def lookup(answer: str) -> Any:
        if isinstance(row, Exception):
            raise row
        return row

    async def rendered(b: dict[str, Any]) -> list[int] | None:
        return (render or {}).get(json.dumps(b["messages"]))

    asyncio.run(resolve(made, body, lookup, rendered, log_on=log_on, tenant=tenant))
    return made.result


def test_resolve_names_not_found_unavailable_and_the_tokens() -> None:
    before = json.dumps(fingerprint("messages", msgs()))
    asking = msgs(diagnostics={"previous_message_id": "msg_old"}, system="changed")
    assert _resolved(asking, None) == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert _resolved(asking, Row("responses", before, 10))["cache_miss_reason"]["type"] == \
        "previous_message_not_found"
    assert _resolved(asking, Row("messages", before, None)) == \
        {"cache_miss_reason": {"type": "unavailable"}}
    assert _resolved(asking, SparkCacheError("locked")) == \
        {"cache_miss_reason": {"type": "unavailable"}}
    assert _resolved(asking, Row("messages", before, 40), log_on=False) == \
        {"cache_miss_reason": {"type": "unavailable"}}
    assert _resolved(asking, Row("messages", before, 40)) == {"cache_miss_reason": {
        "type": "system_changed", "cache_missed_input_tokens": 40}}
    same = msgs(diagnostics={"previous_message_id": "msg_old"})
    assert _resolved(same, Row("messages", before, 40)) is None
    edited = msgs(diagnostics={"previous_message_id": "msg_old"},
                  messages=[{"role": "user", "content": "bye"}])
    renders = {json.dumps(edited["messages"]): [1, 2, 3, 4, 5, 6],
               json.dumps([{"role": "user", "content": ""}]): [1, 2, 3, 9]}
    assert _resolved(edited, Row("messages", before, 40), render=renders) == {
        "cache_miss_reason": {"type": "messages_changed", "cache_missed_input_tokens": 37}}


def test_the_editor_edits_message_start_and_response_completed_across_chunks() -> None:
    made = Plan("messages", "msg_new", {}, True, "msg_old",
                {"cache_miss_reason": {"type": "unavailable"}})
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "tiny",
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 0}}}
    stream = (b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n"
              b"event: ping\ndata: {\"type\": \"ping\"}\n\n")
    editor = Editor(made)
    out = b"".join(editor.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + editor.rest()
    event = json.loads(out.split(b"\n\n")[0].split(b"data: ")[1])
    message = Message.model_validate(event["message"])
    assert message.id == "msg_new"
    assert message.diagnostics is not None and message.diagnostics.cache_miss_reason is not None
    assert message.diagnostics.cache_miss_reason.type == "unavailable"
    assert out.split(b"\n\n")[1] == b"event: ping\ndata: {\"type\": \"ping\"}"
    done = Plan("responses", "resp_1", {}, True, "resp_0", {"type": "cache_hit"})
    editor = Editor(done)
    out = editor.feed(b'data: {"type":"response.completed","response":{"id":"resp_1"}}\n\n')
    assert json.loads(out[6:])["response"]["prompt_cache_diagnostics"] == {"type": "cache_hit"}


def test_another_tenants_request_is_compared_with_nothing() -> None:
    """A request of tenant b naming tenant a's answer learns no part and no count
    of a's prompt: not found (Anthropic), or a changed key with nothing reusable
    (Responses), even when the prompts are the same."""
    before = json.dumps(fingerprint("messages", msgs()))
    same = msgs(diagnostics={"previous_message_id": "msg_old"})
    assert _resolved(same, Row("messages", before, 40, "a"), tenant="a") is None
    assert _resolved(same, Row("messages", before, 40, "a"), tenant="b") == \
        {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert _resolved(same, Row("messages", before, 40, "a")) == \
        {"cache_miss_reason": {"type": "previous_message_not_found"}}
    earlier = json.dumps(fingerprint("responses", resp()))
    asking = resp(prompt_cache_options={"comparison_response_id": "resp_old"})
    assert _resolved(asking, Row("responses", earlier, 40, "a"), api="responses",
                     tenant="a") == {"type": "cache_hit"}
    assert _resolved(asking, Row("responses", earlier, 40, "a"), api="responses",
                     tenant="b") == {"type": "cache_miss", "reason": "prompt_cache_key_changed",
                                     "cache_missed_tokens": 0,
                                     "comparison_reusable_tokens": 0}
