"""Entry point: ``python3 main.py [--config PATH] [--host H] [--port P] [--threads N] [COMMAND]``.

See ``python3 main.py --help`` and README.md.
"""
from hermes_service.cli import cli

if __name__ == "__main__":
    cli()
