"""Child process behind ``spore plugins``: loads the plugins and prints their status as JSON.

The listing process itself never imports a plugin; a plugin that crashes the interpreter on
import takes down only this child. A plugin error in strict mode is reported in the JSON line
(``{"error": ..., "cause": ...}``); the exit status is 0 whenever that line is printed.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _report(value: dict[str, Any]) -> None:
    """``value`` as a JSON line of its own, even after a plugin printed without a newline."""
    print("\n" + json.dumps(value))


def main() -> int:
    from spore.cli import cli
    from spore.plugins import PluginError, get_manager

    manager = get_manager()
    try:
        manager.add_commands(cli)
        infos = manager.plugins(include_builtin=True)
    except PluginError as exc:
        cause = exc.__cause__
        _report({"error": str(exc), "cause": repr(cause) if cause else None})
        return 0
    _report({"plugins": [i.to_dict() for i in infos], "notes": manager.notes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
