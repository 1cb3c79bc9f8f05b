"""Fixtures of the native-backend tests (engine.native): every test here needs the compiled
kernels (the machine kinds this project runs on all have a C compiler), and many run at one and at
two torch threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.native import ops


@pytest.fixture(autouse=True)
def _native() -> None:
    assert ops.available(), ops.reason()


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield int(request.param)
    torch.set_num_threads(before)
