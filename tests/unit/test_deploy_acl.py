"""The ACL rules name keys through shared/keys.py only: every key a service may touch is a ``Keys`` name,
and every ``Keys`` name some service touches has a rule (a new key without one fails here, not in a
deployment that refuses it)."""

from __future__ import annotations

import inspect

from shared.keys import Keys
from tools.deploy import acl

# Written and read only by the operator's admin and read-only ops users (dressage up, dressage status).
ADMIN_ONLY = {"ops_degraded"}


def _key_names(keys: Keys) -> dict[str, str]:
    """Every fixed key name of the contract, by property (heartbeats are per service: ``Keys.health``)."""
    return {name: getattr(keys, name) for name, member in inspect.getmembers(Keys)
            if isinstance(member, property) and name not in {"health_prefix"}}


def _selectors(rules: dict[str, acl.Rule]) -> set[str]:
    return {sel.split("~", 1)[1] for rule in rules.values() for _, sels in rule.grants for sel in sels}


def test_every_key_of_the_contract_has_a_rule() -> None:
    keys = Keys("px")
    granted = _selectors(acl.rules(keys))
    channels = {c for rule in acl.rules(keys).values() for c in rule.channels}
    missing = {name for name, key in _key_names(keys).items()
               if key not in granted and key not in channels and name not in ADMIN_ONLY}
    assert not missing, f"Keys names no ACL rule grants: {sorted(missing)}"


def test_every_selector_is_a_key_of_the_contract() -> None:
    keys = Keys("px")
    known = set(_key_names(keys).values()) | {keys.health(s, "*") for s in acl.SERVICES}
    stray = _selectors(acl.rules(keys)) - known
    assert not stray, f"ACL selectors that are not shared/keys.py names: {sorted(stray)}"


def test_the_prefix_moves_every_selector() -> None:
    text = acl.render("px", {s: "a-strong-password-" + s for s in acl.USERS})
    selectors = [w for line in text.splitlines() for w in line.replace("(", " ").replace(")", " ").split()
                 if w.startswith(("~", "%R~", "&")) and not w.lstrip("%R~&").startswith("rq:")]
    assert selectors and all(w.split("~", 1)[-1].lstrip("&").startswith("px:") for w in selectors)
