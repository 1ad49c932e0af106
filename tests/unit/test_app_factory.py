"""The app factory's Flask class (hermes_service/app.py): Flask's ``ensure_sync`` override."""
from __future__ import annotations

import functools
import re

import pytest
from flask import Flask

from hermes_service.app import ServiceFlask


def plain():
    return "plain"


async def coroutine():
    return "async"


def test_a_plain_function_is_returned_as_it_is_and_asked_about_once(monkeypatch):
    app = ServiceFlask(__name__)
    asked = []
    stock = Flask.ensure_sync
    monkeypatch.setattr(Flask, "ensure_sync", lambda self, f: asked.append(f) or stock(self, f))
    assert app.ensure_sync(plain) is plain and app.ensure_sync(plain) is plain
    assert asked == [plain]


def test_other_callables_go_to_flask_every_time_as_before():
    app, stock_app = ServiceFlask(__name__), Flask(__name__)
    class View:
        def get(self):
            return "bound"
    part, bound = functools.partial(plain), View().get     # a new bound method on each access
    for func in (part, bound, len):
        assert app.ensure_sync(func) is stock_app.ensure_sync(func) is func
    # an async def is Flask's business, each time: wrapped (with asgiref) or refused
    try:
        expected = stock_app.ensure_sync(coroutine)
    except RuntimeError as err:             # Flask without its "async" extra
        with pytest.raises(RuntimeError, match=re.escape(str(err)[:20])):
            app.ensure_sync(coroutine)
        with pytest.raises(RuntimeError):
            app.ensure_sync(coroutine)      # not remembered as plain
    else:
        assert app.ensure_sync(coroutine) is not coroutine and expected is not coroutine
