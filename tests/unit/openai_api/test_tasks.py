"""Front-end chores (hermes_service/openai_api/tasks.py)."""
import json

from hermes_service.openai_api import tasks


def test_a_task_is_named_by_metadata_or_its_prompt():
    assert tasks.task_of({"metadata": {"task": "title_generation"}}, "hi") == "title_generation"
    assert tasks.task_of({}, "### Task:\nGenerate tags") == "prompt"
    assert tasks.task_of({"metadata": "x"}, "an ordinary question about ### Task:") is None


def test_answers_are_the_json_the_template_asks_for():
    title = tasks.answer('### Task:\nJSON format: { "title": "t" }\n<chat_history>\n'
                         "USER: one two three four five six seven\n</chat_history>")
    assert json.loads(title) == {"title": "one two three four five six"}
    assert json.loads(tasks.answer('JSON format: { "follow_ups": ["q"] }')) == \
        {"follow_ups": []}
    assert json.loads(tasks.answer('JSON format: {"title": "t"}')) == {"title": "New chat"}
    assert tasks.answer("### Task:\nContinue the text") == ""
