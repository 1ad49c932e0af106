"""Chunk framing (hermes_service/openai_api/stream.py)."""
import json

from hermes_service.openai_api.stream import DONE, Chunks, completion, frame


def parse(text):
    assert text.startswith("data: ") and text.endswith("\n\n") and "\n" not in text[:-2]
    return json.loads(text[6:])


def test_chunks_carry_every_field_the_spec_requires():
    c = Chunks("chatcmpl-1", 7, "hermes")
    for made in (c.role(), c.content("a\nb"), c.finish(None)):
        chunk = parse(made)
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-1"
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
    assert parse(c.role())["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert parse(c.finish(None))["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                   "finish_reason": "stop"}
    usage = parse(c.usage({"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert DONE == "data: [DONE]\n\n"


def test_a_lone_surrogate_from_the_sandbox_does_not_break_the_stream():
    text = frame({"x": "half \ud83d!"})
    text.encode()                                      # valid UTF-8 on the wire
    assert json.loads(text[6:]) == {"x": "half \ud83d!"}


def test_a_whole_answer():
    body = completion("chatcmpl-1", 7, "hermes", "hi", "length",
                      {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3})
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["refusal"] is None
