"""Stored Responses answers (issue 53): `previous_response_id` continues a stored answer's
conversation, GET and DELETE /v1/responses/{id} read and forget one, through the openai SDK
unchanged, on both runtimes; bounded, and per API key."""

from __future__ import annotations

import openai
import pytest

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}


def sdk_of(server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_a_stored_answer_is_continued_read_and_deleted(live_server, backend):
    sdk = sdk_of(live_server(lambda: backend, model="tiny"))
    first = sdk.responses.create(input="How are you today?", **GREEDY)
    assert first.store is True
    follow = sdk.responses.create(previous_response_id=first.id, input="What is two plus two?", **GREEDY)
    assert follow.previous_response_id == first.id
    # The same as sending the conversation's items again, by hand: the first's input and output.
    items = [{"role": "user", "content": "How are you today?"}, *(i.model_dump() for i in first.output)]
    by_hand = sdk.responses.create(input=[*items, {"role": "user", "content": "What is two plus two?"}], **GREEDY)
    assert follow.output_text == by_hand.output_text
    assert follow.usage.input_tokens == by_hand.usage.input_tokens > first.usage.input_tokens
    assert sdk.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert sdk.responses.delete(first.id) is None  # the SDK returns nothing for a deletion
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.responses.create(previous_response_id=first.id, input="Again?", **GREEDY)
    assert raised.value.body["code"] == "previous_response_not_found"
    assert raised.value.body["param"] == "previous_response_id"


def test_streamed_answers_are_stored_and_store_false_is_not(live_server, backend):
    sdk = sdk_of(live_server(lambda: backend, model="tiny"))
    with sdk.responses.stream(input="Once upon a time", **GREEDY) as stream:
        final = stream.get_final_response()
    assert sdk.responses.retrieve(final.id).output_text == final.output_text
    unkept = sdk.responses.create(input="Once upon a time", store=False, **GREEDY)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unkept.id)


def test_the_store_is_bounded_and_per_key(live_server, backend):
    server = live_server(lambda: backend, model="tiny", responses_store=2, api_key="k1,k2")
    one, two = sdk_of(server, "k1"), sdk_of(server, "k2")
    made = [one.responses.create(input=f"Line {i}.", **GREEDY) for i in range(3)]
    with pytest.raises(openai.NotFoundError):  # the least recently used went first
        one.responses.retrieve(made[0].id)
    assert [one.responses.retrieve(r.id).id for r in made[1:]] == [r.id for r in made[1:]]
    with pytest.raises(openai.NotFoundError):  # another key's answers are not there for it
        two.responses.retrieve(made[2].id)
    with pytest.raises(openai.NotFoundError):
        two.responses.create(previous_response_id=made[2].id, input="Go on.", **GREEDY)
