"""`--lora-modules name=path,name=path`: the adapters a worker serves by name, and the model names
a gateway or `qworker batch` accepts for them. The standard library only: the gateway, which holds
no engine, reads the same setting."""

from __future__ import annotations

import re

from qworker.errors import AdapterSettingsError

# A name may become a path component (a subdirectory of --lora-dir): no separators, no dot-dot.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def parse_lora_modules(value: str | None) -> dict[str, str]:
    """`name=path,name=path` -> {name: path}; AdapterSettingsError naming the bad entry. A gateway
    may give names alone (`name,name`): their paths are then empty."""
    modules: dict[str, str] = {}
    for entry in (value or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not name or (sep and not path):
            raise AdapterSettingsError(f"--lora-modules entry {entry!r} is not name=path")
        if not NAME_PATTERN.match(name):
            raise AdapterSettingsError(
                f"--lora-modules name {name!r} must match {NAME_PATTERN.pattern} (letters, digits, . _ -)"
            )
        if name in modules:
            raise AdapterSettingsError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules
