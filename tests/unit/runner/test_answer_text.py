"""Deltas that add up to the recorded answer (docs/mnote-client.md §Events;
hermes_service/runner/answer_text.py): chunks as Hermes 0.19.0 streams them, against what its
record holds (transcript.said)."""
import pytest

from hermes_service.runner.answer_text import AnswerText

BREAK = "\n\n"


def stream(chunks):
    """Feed ``chunks`` (a None is a tool call); the deltas handed out."""
    text = AnswerText()
    out = []
    for chunk in chunks:
        if chunk is None:
            text.tool_call()
        else:
            out.append(text.feed(chunk))
    return text, [d for d in out if d]


@pytest.mark.parametrize("chunks, answer", [
    (["echo #1", ": hi"], "echo #1: hi"),
    # Hermes's paragraph break after tool calls, though nothing was shown before
    ([None, "\n\n[demo model]", " summary"], "[demo model] summary"),
    ([None, None, "\n\ntools done: x"], "tools done: x"),
    # what the model wrote before its calls, then the answer: one break between pieces
    (["calling a.", None, "\n\ncalling b.", None, "\n\nthe answer"],
     "calling a.\n\ncalling b.\n\nthe answer"),
    # whitespace at a piece's edges (Hermes's record strips each message)
    (["  calling a. ", "\n", None, "\n\n", "  answer\n", "  goes on  ", "\n"],
     "calling a.\n\nanswer\n  goes on"),
    # a step that said nothing adds no break
    (["first", None, None, "\n\nsecond"], "first\n\nsecond"),
])
def test_the_deltas_add_up_to_what_hermes_records(chunks, answer):
    text, deltas = stream(chunks)
    assert "".join(deltas) == answer == text.text
    assert all(d for d in deltas)


def test_the_end_hermes_did_not_stream_is_sent_once():
    text, deltas = stream(["calling a.", None])
    assert text.rest("calling a.\n\nthe answer") == "\n\nthe answer"
    assert text.text == "calling a.\n\nthe answer"
    assert text.rest("calling a.\n\nthe answer") == ""


def test_deltas_that_differ_from_the_record_get_no_rest():
    text, _ = stream(["the key is sk-abcdefghijklmnop"])
    assert text.rest("the key is sk-abc...mnop") == ""
