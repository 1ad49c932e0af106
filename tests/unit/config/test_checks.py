"""Cross-key checks of the config (hermes_service/config/checks.py) not tested with their
own subsystem."""
from __future__ import annotations

import pytest

from hermes_service.config import ConfigError


def test_an_unattended_setting_names_a_route_family_of_this_service(make_config):
    # a typo ("v-1", "panel") would silently leave the default deny
    with pytest.raises(ConfigError) as err:
        make_config({"hermes": {"approvals": {"unattended": {"panel": "run", "v1": "run"}}}})
    [problem] = [p for p in err.value.problems if "unattended" in p]
    assert "unattended.panel: not a route family" in problem and "v1" in problem
    cfg = make_config({"hermes": {"approvals": {"unattended": {
        "v1": "run", "mnote": "deny", "openai": "run"}}}})
    assert dict(cfg.hermes.approvals.unattended) == {"v1": "run", "mnote": "deny",
                                                     "openai": "run"}
