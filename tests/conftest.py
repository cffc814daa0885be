"""Shared test settings.

Every test uses tiny models; extra intra-op threads only fight over the few cores of a CI machine
(and with the ranks the distributed tests spawn), which makes everything many times slower.
"""

from pathlib import Path

import pytest
import torch
from runs import write_corpus


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """The trainer tests' corpus (400 small functions); a module may override it with its own."""
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 400)


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    """Every test runs in a directory of its own: what a user's `meshlm train` left in the checkout (runs/default)
    or what another test wrote must not change a test's outcome. Tests reach the repository by its path."""
    monkeypatch.chdir(tmp_path)
