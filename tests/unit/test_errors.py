"""hermes_service.errors.schema_error: the one reading of a jsonschema error."""
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from hermes_service.errors import schema_error

ONE = {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
ANY = {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}


def first(schema: dict, instance) -> tuple[list[str], str]:
    return schema_error(best_match(Draft202012Validator(schema).iter_errors(instance)))


def test_one_of_required_names_the_fields_not_the_instance():
    for instance in ({"secret": "x" * 50}, {"a": 1, "b": 2, "secret": "x"}):
        assert first(ONE, instance) == ([], "needs exactly one of a, b")
    assert first(ANY, {"secret": "x"}) == ([], "needs one of a, b")


def test_other_one_of_keeps_the_default_reading():
    schema = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    assert "is not valid under any of the given schemas" in first(schema, [1])[1]
