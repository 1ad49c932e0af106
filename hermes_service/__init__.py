"""hermes-service: the Hermes Agent CLI behind a REST API (see README.md).

``create_app`` is imported on first use, so that a command that serves nothing (an operator
command, the reference kernel's command form) does not load the web app.
"""
__all__ = ["create_app"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
