"""Entry point: ``.venv/bin/python main.py [--config PATH] [--host H] [--port P] [--threads N]
[COMMAND]``.

See ``.venv/bin/python main.py --help`` and README.md.
"""
from hermes_service.cli import cli

if __name__ == "__main__":
    cli()
