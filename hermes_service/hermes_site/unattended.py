"""Commands Hermes flags where nobody can approve them (docs/sandbox.md §What approvals are;
``hermes.approvals.unattended``). Loaded in every Hermes process the service starts (this
folder is on its ``PYTHONPATH``); standard library only.

The service starts a Hermes process whose turns have nobody to ask — every CLI turn, a warm
process of a route family without a user to ask (the v1 API; client runs with
``hermes.approvals.mode: deny``) — with :data:`ENV` set to that family's choice:

* ``run``: the service also sets ``HERMES_YOLO_MODE=1``: Hermes 0.19.0 runs the commands it
  flags without asking — inside the sandbox, which is the boundary —, its hard-line floor
  (``tools.approval.HARDLINE_PATTERNS``: ``rm -rf /``, ``~`` or a system folder, ``mkfs``, a
  fork bomb, shutdown…) and ``approvals.deny`` still blocking;
* ``deny``: Hermes would ask a human who is not there — the CLI waits ``approvals.timeout``
  for a terminal nobody types in — and then tells the model "BLOCKED: User denied this
  command", a user who was never asked. Here the question is answered ``deny`` at once
  (``tools.approval.prompt_dangerous_approval``) and the refusal says who refused
  (:func:`refusal`), in ``check_all_command_guards`` and ``check_dangerous_command``, the
  functions the terminal and code tools call.

:data:`ROUTE_ENV` names the route for the text (``the v1 API``…).
"""
import functools

ENV = "HERMES_SERVICE_UNATTENDED"          # "deny" | "run"
ROUTE_ENV = "HERMES_SERVICE_UNATTENDED_ROUTE"
#: Hermes's text of a command a user denied (tools.approval)
DENIED_PREFIX = "BLOCKED: User denied"


def refusal(description, route):
    """What the model is told of a flagged command nobody could approve."""
    what = f" ({description})" if description else ""
    return (f"BLOCKED: this command was flagged by Hermes as dangerous{what}; no one can "
            f"approve it on {route or 'this route'} - see hermes.approvals.unattended in the "
            "service's configuration (docs/sandbox.md, What approvals are). Nobody denied it "
            "and nobody was asked. Do not retry it or rephrase it: do the task without it, or "
            "tell the user it needs a command the operator of this service has not allowed.")


def _rewritten(original, route):
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        result = original(*args, **kwargs)
        if isinstance(result, dict) and not result.get("approved", True) and \
                str(result.get("message") or "").startswith(DENIED_PREFIX):
            result = {**result, "message": refusal(result.get("description"), route),
                      "outcome": "denied_unattended"}
        return result
    return guarded


def patch(module, route):
    """Make ``tools.approval`` refuse flagged commands at once, saying who refused."""
    def nobody_to_ask(*_args, **_kwargs):
        return "deny"
    module.prompt_dangerous_approval = nobody_to_ask
    for name in ("check_all_command_guards", "check_dangerous_command"):
        original = getattr(module, name, None)
        if original is not None:
            setattr(module, name, _rewritten(original, route))
