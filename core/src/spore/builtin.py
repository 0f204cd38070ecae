"""spore-core's own plugin, listed as ``core`` by ``spore plugins --all``."""

from __future__ import annotations

from spore import hookimpl
from spore.doctor import Report, core_checks


@hookimpl
def spore_doctor(report: Report) -> None:
    core_checks(report)
