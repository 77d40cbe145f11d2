"""The Python API reference's rules, for mkdocs (docs/hooks.py) and its griffe extension.

``API``: the modules docs/reference/api.md renders. Each name in a module's ``__all__``, and each
public method of a class among them, must have a docstring of its own: the strict build fails on
one without (``undocumented``). ``SphinxRoles`` turns the roles the code's docstrings use
(``:class:`~outbox.errors.NotMigrated```) into code spans, which mkdocstrings would print raw.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

API = ("outbox", "outbox.inbox", "outbox.testing", "outbox.errors")
ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)`")


def _code(m: re.Match[str]) -> str:
    name = m.group(2)
    return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)


def undocumented(modules: tuple[str, ...] = API) -> list[str]:
    """Every public name of ``modules`` (their ``__all__``) without a docstring of its own."""
    package = griffe.load("outbox", resolve_aliases=True, resolve_external=False)
    missing = []
    for module_path in modules:
        module = package if module_path == "outbox" else package[module_path.removeprefix("outbox.")]
        exported = module.exports
        if not exported:
            missing.append(f"{module_path}: no __all__ (which of its names are public?)")
            continue
        for name in exported:
            name = name if isinstance(name, str) else name.name
            if name == "__version__" or name in ("inbox",):
                continue
            obj = module[name]
            target = obj.final_target if obj.is_alias else obj
            if not target.docstring:
                missing.append(f"{module_path}.{name}")
            if target.is_class:
                for member_name, member in target.members.items():
                    if member_name.startswith("_") or not member.is_function:
                        continue
                    if not member.docstring:
                        missing.append(f"{module_path}.{name}.{member_name}")
    return missing
