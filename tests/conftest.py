"""Shared fixtures: repository paths and the measured data shipped beside the repo."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TABLES = REPO / "tables"
SHARED = REPO.parent / "shared"
SWEEP = SHARED / "data" / "ppd-h100" / "sweep.csv"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def sweep_csv() -> Path:
    if not SWEEP.exists():
        pytest.skip(f"measured H100 data not found at {SWEEP}")
    return SWEEP
