"""What the repository ships, read from git, never from the working copy.

The operator edits the working copy: the README's quick start has them set a provider in
``config.yaml``, and they add keys or pick a runner there. A test that checks what is shipped
(the file as it comes in a fresh clone) reads it through these helpers, so that ``make test``
passes whatever the operator has configured.

"Shipped" is the file in git's index (``git show :<path>``): in a clean clone that is
``HEAD``'s; a change to a shipped file is tested once it is staged (``git add``), while an
unstaged local edit never is. Paths are relative to the repository's top level (also when
the tests run from a copy inside it, as ``mutation/run.py`` does). Outside a git checkout
(an unpacked archive) the tests that need these skip and say why.
"""
from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _git(*args: str, cwd: Path = HERE, **kw) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=60, **kw)
    except OSError as exc:            # no git at all
        pytest.skip(f"reads the shipped files from git, which cannot run here: {exc}")
    return res


@cache
def _top() -> Path:
    res = _git("rev-parse", "--show-toplevel")
    if res.returncode != 0:
        pytest.skip("reads the shipped files from git, and this is not a git checkout: "
                    + res.stderr.decode(errors="replace").strip())
    return Path(res.stdout.decode().strip())


def shipped_text(path: str) -> str:
    """The shipped text of ``path`` (e.g. ``"config.yaml"``); fails if git has no such file."""
    res = _git("show", f":{path}", cwd=_top())
    if res.returncode != 0:
        pytest.fail(f"git has no shipped {path}: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout.decode("utf-8")


def shipped_tree(path: str, dest: Path) -> Path:
    """The shipped files under folder ``path`` (e.g. ``"users_template"``) written into
    ``dest`` (created; returned), with their file modes."""
    files = _git("ls-files", "-z", "--", path, cwd=_top()).stdout
    if not files:
        pytest.fail(f"git has no shipped files under {path}/")
    staging = Path(dest).with_name(Path(dest).name + ".git-export")
    res = _git("checkout-index", "-z", "--stdin", f"--prefix={staging}/", cwd=_top(),
               input=files)
    if res.returncode != 0:
        pytest.fail(f"cannot export {path}/ from git: {res.stderr.decode(errors='replace')}")
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    (staging / path).rename(dest)
    shutil.rmtree(staging)
    return Path(dest)


def shipped_file(path: str, dest: Path) -> Path:
    """The shipped text of ``path`` written to the file ``dest`` (returned)."""
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    Path(dest).write_text(shipped_text(path), encoding="utf-8")
    return Path(dest)
