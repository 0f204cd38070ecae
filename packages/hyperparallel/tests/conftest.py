"""Every test module runs in its own empty working directory: a test never reads or writes the
user's (a ``spore train`` run there leaves ``runs/default`` behind)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def _empty_working_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(before)
