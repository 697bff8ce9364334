from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared() -> Path:
    """The read-only ../shared folder beside the repository (data, tokenizers, peers)."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not present")
    return SHARED
