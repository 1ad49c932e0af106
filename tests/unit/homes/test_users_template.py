"""The users template keeps a CLI turn quiet and safe, unit level;
the end-to-end proofs are test_e2e_egress.py and test_e2e_approvals.py."""
import json
import re
from pathlib import Path

import yaml

from hermes_service.homes.users import UserHomes
from support.fixtures import ROOT, hermes_bin
from support.shipped import shipped_text, shipped_tree


def test_update_check_cache_matches_the_pinned_and_installed_hermes():
    stamp = json.loads(shipped_text("users_template/.update_check"))
    pinned = re.search(r"^hermes-agent(?:\[[a-z,]+\])?==(\S+)$", (ROOT / "requirements-hermes.txt").read_text(),
                       re.M).group(1)
    site = Path(hermes_bin()).resolve().parent.parent / "lib"
    installed = [p.name[len("hermes_agent-"):-len(".dist-info")]
                 for p in site.glob("python3*/site-packages/hermes_agent-*.dist-info")]
    assert stamp["ver"] == pinned and installed == [pinned], (stamp, pinned, installed)
    assert stamp["rev"] is None and stamp["behind"] == 0
    assert stamp["ts"] > 4e9                       # "checked" far in the future: never again


def homes_for(make_config, tmp_path, template_cfg: dict | None):
    """Homes from the shipped template, its config.yaml replaced by ``template_cfg`` if given."""
    template = shipped_tree("users_template", tmp_path / "template")
    if template_cfg is not None:
        (template / "config.yaml").write_text(yaml.safe_dump(template_cfg))
    cfg = make_config({"paths": {"users_template": str(template)}})
    return UserHomes(cfg.paths, cfg.hermes)


def test_approvals_need_a_human_unless_the_template_chooses(make_config, tmp_path):
    shipped = homes_for(make_config, tmp_path / "a", None).render_config()["approvals"]
    assert shipped["mode"] == "manual" and shipped["cron_mode"] == "deny"
    bare = homes_for(make_config, tmp_path / "b", {"display": {"tool_progress": "off"}})
    assert bare.render_config()["approvals"] == {"mode": "manual", "cron_mode": "deny"}
    chosen = homes_for(make_config, tmp_path / "c", {"approvals": {"mode": "smart"}})
    assert chosen.render_config()["approvals"]["mode"] == "smart"     # the admin's explicit choice


def test_every_home_gets_the_update_check_stamp(make_config, tmp_path):
    homes = homes_for(make_config, tmp_path, None)
    home = homes.ensure("alice")
    assert json.loads((home.hermes_home / ".update_check").read_text())["ts"] > 4e9


def test_a_template_edit_reaches_the_next_turns_home_without_a_reload(make_config, tmp_path):
    """docs/configuring.md: a changed template brings every home up to date on its next run. The parse and
    hash of the template are cached per turn (the first token's path), keyed on each file's
    inode, size and mtime: an edit (even one keeping the size), a new file and a removed one
    each refresh the home."""
    import os
    homes = homes_for(make_config, tmp_path, {"display": {"tool_progress": "off"}})
    template = homes.template
    home = homes.ensure("alice")
    assert yaml.safe_load((home.hermes_home / "config.yaml").read_text())["display"] == \
        {"tool_progress": "off"}
    homes.ensure("alice")                                      # cached: nothing changed
    path = template / "config.yaml"
    st = path.stat()
    path.write_text(path.read_text().replace("'off'", "'new'"))        # the same size
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))         # a later mtime
    homes.ensure("alice")
    assert yaml.safe_load((home.hermes_home / "config.yaml").read_text())["display"] == \
        {"tool_progress": "new"}
    (template / "NOTES.md").write_text("added")
    homes.ensure("alice")
    assert (home.hermes_home / "NOTES.md").read_text() == "added"
