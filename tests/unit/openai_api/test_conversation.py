"""Which session a request continues (hermes_service/openai_api/conversation.py): the
history's digest, the seeded first message, hostile histories."""
import pytest

from hermes_service.errors import BadRequest
from hermes_service.openai_api.conversation import (
    history_digest,
    plan,
    read_messages,
    seeded,
)


def test_roles_and_text_parts_are_read():
    pairs = read_messages([{"role": "developer", "content": "rules"},
                           {"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}]}])
    assert pairs == [("system", "rules"), ("user", "a\nb")]


@pytest.mark.parametrize("messages, code", [
    ([{"role": "tool", "content": "r"}, {"role": "user", "content": "x"}], "tools_unsupported"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
      {"role": "user", "content": "x"}], "tools_unsupported"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "unsupported_content"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "unsupported_content"),
    ([{"role": "user", "content": "   "}], "invalid_request"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "invalid_request"),
])
def test_refused_histories(messages, code):
    with pytest.raises(BadRequest) as caught:
        read_messages(messages)
    assert caught.value.code == code and caught.value.extra["param"]


def test_the_digest_ignores_surrounding_space_but_not_roles_or_order():
    a = [("user", "hi"), ("assistant", "hello ")]
    assert history_digest(a) == history_digest([("user", " hi"), ("assistant", "hello")])
    assert history_digest(a) != history_digest([("assistant", "hi"), ("user", "hello")])
    assert history_digest(a) != history_digest(list(reversed(a)))
    # a text cannot forge a role boundary: JSON keeps the pairs apart
    assert history_digest([("user", 'hi","assistant')]) != \
        history_digest([("user", "hi"), ("assistant", "")])


def test_a_single_message_runs_alone_and_a_history_is_seeded():
    assert seeded([("user", "hi")]) == "hi"
    text = seeded([("system", "be brief"), ("user", "a"), ("assistant", "b"), ("user", "c")])
    assert text.index("be brief") < text.index("User: a") < text.index("Assistant: b") \
        < text.index("[The user's new message]\nc")


def test_plan_prefers_the_named_session_then_the_newest_match():
    pairs = [("user", "a"), ("assistant", "b"), ("user", "c")]
    prior = history_digest(pairs[:-1])
    recs = [{"session_id": "old", "history_sha256": prior},
            {"session_id": "new", "history_sha256": prior},
            {"session_id": "other", "history_sha256": "0" * 64}]
    assert plan(recs, pairs, None).session_id == "new"
    assert plan(recs, pairs, None).message == "c"
    assert plan(recs, pairs, {"session_id": "named"}).session_id == "named"
    fresh = plan(recs, [("user", "x"), ("assistant", "y"), ("user", "c")], None)
    assert fresh.session_id is None and "Assistant: y" in fresh.message
    # a first message never joins a session, whatever digest a record holds
    empty = history_digest([])
    assert plan([{"session_id": "s", "history_sha256": empty}], [("user", "c")],
                None).session_id is None
