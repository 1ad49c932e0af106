"""The OpenAI-compatible routes: any OpenAI client (the SDKs, LangChain, Open WebUI) talks to
its user's own sandboxed Hermes (docs/openai-api.md).

Modules: :mod:`.settings` (the ``openai`` config section), :mod:`.extension` (the seam's
hooks), :mod:`.routes` (the routes and a request's turn), :mod:`.schemas` (request and reply
shapes), :mod:`.identity` (who the user is), :mod:`.conversation` (which Hermes session a
request continues), :mod:`.stream` (chunk framing), :mod:`.turn` (a streamed turn's thread and
disconnects), :mod:`.tasks` (front-end chores), :mod:`.usage` (a turn's usage, bounded by the
pass-through's count), :mod:`.errors` (OpenAI's error shape).

An extension, the outer layer like ``mnote/``: the core never imports it but in
``installed.py``. It may import config, config_fields, conversations, errors, extensions,
homes, model_proxy, runner, service_objects and web.
"""
from .extension import OpenAIExtension

#: the extension object :func:`hermes_service.installed.extensions` lists
extension = OpenAIExtension()
