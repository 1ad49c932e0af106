"""pyproject.toml (the package's metadata, ``pip install -e .``) agrees with the pinned lock
the Makefile installs (requirements.txt, requirements-dev.txt) and with the code: every pin
names a declared dependency inside its range, the packages found are every folder of
hermes_service/ with code (hermes_site/ included), and the console script exists."""
import tomllib

from packaging.requirements import Requirement

from support.fixtures import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
PROJECT = PYPROJECT["project"]


def pins(name: str) -> dict[str, str]:
    """``{normalised name: pinned version}`` of a requirements file (``-r`` lines skipped)."""
    out = {}
    for line in (ROOT / name).read_text("utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            [spec] = req.specifier
            assert spec.operator == "==", f"{name}: {line} is not a pin"
            out[_norm(req.name)] = spec.version
    return out


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def declared(reqs: list[str]) -> dict[str, Requirement]:
    return {_norm(r.name): r for r in map(Requirement, reqs)}


def test_the_runtime_dependencies_are_the_pinned_ones_within_their_ranges():
    lock, deps = pins("requirements.txt"), declared(PROJECT["dependencies"])
    assert set(lock) == set(deps)
    for name, version in lock.items():
        assert deps[name].specifier.contains(version), (name, version, str(deps[name]))


def test_the_dev_extra_is_requirements_dev_within_its_ranges():
    lock, deps = pins("requirements-dev.txt"), declared(PROJECT["optional-dependencies"]["dev"])
    assert set(lock) == set(deps)
    for name, version in lock.items():
        assert deps[name].specifier.contains(version), (name, version, str(deps[name]))


def test_every_folder_of_the_package_with_code_is_installed():
    from setuptools import find_namespace_packages
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert find["namespaces"] is True          # hermes_site/ has no __init__.py
    found = set(find_namespace_packages(str(ROOT), include=find["include"]))
    code = {".".join(p.parent.relative_to(ROOT).parts)
            for p in (ROOT / "hermes_service").rglob("*.py") if "__pycache__" not in p.parts}
    assert "hermes_service.hermes_site" in code and code <= found


def test_the_console_script_is_the_cli_main_py_runs():
    import click

    from hermes_service import cli
    module, _, attr = PROJECT["scripts"]["hermes-service"].partition(":")
    assert module == "hermes_service.cli" and isinstance(getattr(cli, attr), click.Group)
    assert "from hermes_service.cli import cli" in (ROOT / "main.py").read_text("utf-8")
