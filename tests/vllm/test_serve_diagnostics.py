"""Cache-miss diagnostics on a real ``sparkcache serve``, through the official clients.

One server (``served``): Anthropic's ``diagnostics.previous_message_id``
(with the beta header, whole and streamed, and without the header) and the
Responses' ``prompt_cache_options.comparison_response_id`` (whole and
streamed), every answer parsed into the SDK's own types.  The missed tokens
are counted by hand from the texts (:data:`serve_helpers.SYSTEM_FRAME`):
the previous request's prompt beyond the tokens the two prompts share before
the part that differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import MODEL_NAME, SYSTEM_FRAME, USER_FRAME, Server, system_prompt
from tiny_model import NEEDS_VLLM

from sparkcache.serve.diagnostics import BETA
from sparkcache.store import SnapshotStore

pytestmark = NEEDS_VLLM

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

#: Around an assistant message inside a conversation: <|end|> \n <|assistant|> \n
#: before its text (after the user's text), and <|end|> \n <|user|> \n after it.
TURN_FRAME = 4


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("diag-log") / "server.log"
    with Server(tiny_model_dir, tmp_path_factory.mktemp("diag-store"), log) as server:
        yield server


def clients(server: Server) -> tuple[Any, Any]:
    return (anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0),
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))


def ask(client: Any, system: str, messages: list[dict[str, Any]], previous: str | None,
        **extra: Any) -> Any:
    return client.beta.messages.create(
        model=MODEL_NAME, max_tokens=4, extra_body={"temperature": 0}, system=system,
        messages=messages,
        diagnostics={"previous_message_id": previous}, betas=[BETA], **extra)


def test_a_changed_system_prompt_is_system_changed_with_the_previous_prompt_missed(
        served: Server) -> None:
    client, _ = clients(served)
    first_system, other_system = system_prompt(1, 200), system_prompt(2, 200)
    user = "tell me about rivers"
    first = ask(client, first_system, [{"role": "user", "content": user}], None)
    assert isinstance(first, anthropic.types.beta.BetaMessage)
    assert first.id.startswith("msg_") and first.diagnostics is None
    prompt = SYSTEM_FRAME + len(first_system) + len(user) + USER_FRAME
    u = first.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == prompt

    second = ask(client, other_system, [{"role": "user", "content": user}], first.id)
    assert second.id != first.id
    assert second.diagnostics is not None
    reason = second.diagnostics.cache_miss_reason
    assert isinstance(reason, anthropic.types.beta.BetaCacheMissSystemChanged)
    assert reason.cache_missed_input_tokens == prompt

    # The same prompt, grown by a turn: no divergence, diagnostics null.
    grown = [{"role": "user", "content": user}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "and stones"}]
    third = ask(client, other_system, grown, second.id)
    assert third.diagnostics is None

    # The first message edited: messages_changed, the shared tokens are those
    # before its text (the template's frame and the system prompt).
    edited = [{"role": "user", "content": "tell me about clouds"}, *grown[1:]]
    fourth = ask(client, other_system, edited, third.id)
    third_prompt = (SYSTEM_FRAME + len(other_system) + len(user) + TURN_FRAME + len("ok")
                    + TURN_FRAME + len("and stones") + USER_FRAME)
    assert fourth.diagnostics is not None
    changed = fourth.diagnostics.cache_miss_reason
    assert isinstance(changed, anthropic.types.beta.BetaCacheMissMessagesChanged)
    assert changed.cache_missed_input_tokens == third_prompt - (SYSTEM_FRAME + len(other_system))

    with SnapshotStore(served.folder) as store:
        row = store.request_by_answer(first.id)
    assert row is not None and row.fingerprint is not None and row.api == "messages"
    assert first_system not in row.fingerprint and user not in row.fingerprint


def test_an_unknown_previous_id_is_not_found_and_a_bad_one_a_400(served: Server) -> None:
    client, _ = clients(served)
    answer = ask(client, "be brief", [{"role": "user", "content": "hi"}], "msg_never_seen")
    assert answer.diagnostics is not None
    assert isinstance(answer.diagnostics.cache_miss_reason,
                      anthropic.types.beta.BetaCacheMissPreviousMessageNotFound)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}],
                               extra_body={"diagnostics": {"previous_message_id": 7}})
    assert "diagnostics.previous_message_id" in caught.value.message


def test_streamed_and_unflagged_answers_carry_the_diagnosis(served: Server) -> None:
    client, _ = clients(served)
    system, user = system_prompt(5, 150), "a question"
    # Without the beta header: the diagnostics object alone opts in (the GA form).
    first = client.messages.create(model=MODEL_NAME, max_tokens=4, system=system,
                                   extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": user}],
                                   diagnostics={"previous_message_id": None})
    assert isinstance(first, anthropic.types.Message) and first.diagnostics is None
    with client.beta.messages.stream(
            model=MODEL_NAME, max_tokens=4, extra_body={"temperature": 0},
            system=system_prompt(6, 150), messages=[{"role": "user", "content": user}],
            betas=[BETA], diagnostics={"previous_message_id": first.id}) as stream:
        final = stream.get_final_message()
    assert final.diagnostics is not None
    reason = final.diagnostics.cache_miss_reason
    assert isinstance(reason, anthropic.types.beta.BetaCacheMissSystemChanged)
    assert reason.cache_missed_input_tokens == SYSTEM_FRAME + len(system) + len(user) + USER_FRAME
    assert final.id.startswith("msg_") and final.id != first.id


def test_responses_compare_with_an_earlier_response(served: Server) -> None:
    _, client = clients(served)
    instructions, text = system_prompt(7, 180), "summarise the rivers"
    prompt = SYSTEM_FRAME + len(instructions) + len(text) + USER_FRAME

    def create(**extra: Any) -> Any:
        base: dict[str, Any] = {"model": MODEL_NAME, "instructions": instructions,
                                "input": text, "max_output_tokens": 4, "temperature": 0}
        return client.responses.create(**{**base, **extra})

    first = create(prompt_cache_key="team-a")
    assert first.id.startswith("resp_") and first.prompt_cache_diagnostics is None
    assert first.usage.input_tokens == prompt
    hit = create(prompt_cache_key="team-a",
                 prompt_cache_options={"comparison_response_id": first.id})
    assert isinstance(hit.prompt_cache_diagnostics,
                      openai.types.responses.response.PromptCacheDiagnosticsCacheHit)
    moved = create(prompt_cache_key="team-b",
                   prompt_cache_options={"comparison_response_id": first.id})
    miss = moved.prompt_cache_diagnostics
    assert isinstance(miss, openai.types.responses.response.PromptCacheDiagnosticsCacheMiss)
    # Another key is another tenant: nothing of team-a's is reusable or told.
    assert (miss.reason, miss.cache_missed_tokens, miss.comparison_reusable_tokens) == (
        "prompt_cache_key_changed", 0, 0)
    assert moved.usage.input_tokens_details.cached_tokens == 0
    lost = create(prompt_cache_options={"comparison_response_id": "resp_never_seen"})
    assert lost.prompt_cache_diagnostics is not None
    assert lost.prompt_cache_diagnostics.type == "comparison_response_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        create(prompt_cache_options={"comparison_response_id": "r" * 300})
    assert "comparison_response_id" in str(caught.value)

    # Streamed: response.completed carries it; the input edited is input_changed.
    completed = None
    stream = client.responses.create(
        model=MODEL_NAME, instructions=instructions, input="summarise the stones",
        max_output_tokens=4, temperature=0, prompt_cache_key="team-a", stream=True,
        prompt_cache_options={"comparison_response_id": first.id})
    for event in stream:
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None
    found = completed.prompt_cache_diagnostics
    assert isinstance(found, openai.types.responses.response.PromptCacheDiagnosticsCacheMiss)
    assert (found.reason, found.cache_missed_tokens, found.comparison_reusable_tokens) == (
        "input_changed", prompt - (SYSTEM_FRAME + len(instructions)), prompt)
