"""Loaded by the Python of every Hermes process the service starts (``PYTHONPATH`` names this
folder: ``UserHomes.cli_env``; README §Runners, "A message is text").

``hermes chat --query=…`` treats a query that starts like a path of an existing local image
file (``/…``, ``~/…``, ``./…``, ``file://…``; Hermes 0.19.0 ``cli._detect_file_drop``, called
by ``cli._collect_query_images``) as a dragged-in attachment: it reads that file from the
server and sends it to the model instead of the text. A caller could so probe for files
anywhere on the host and have a vision model describe them. A message given to the service
is always text: this hook makes ``_detect_file_drop`` find nothing, as soon as Hermes's ``cli``
module is imported. Explicit ``--image`` arguments (which the service never passes) are
untouched. Plugins load too late for this (after the query was handled), hence a hook here.
"""
import importlib.abc
import sys


def _no_file_drop(_user_input):
    return None


class _PatchCli(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the top-level ``cli`` module."""

    def find_spec(self, name, path=None, target=None):
        if name != "cli":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_patch(module):
            exec_module(module)
            if hasattr(module, "_detect_file_drop"):
                module._detect_file_drop = _no_file_drop
        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchCli())
