"""Shared test settings.

Every test uses tiny models; extra intra-op threads only fight over the few cores of a CI machine
(and with the ranks the distributed tests spawn), which makes everything many times slower.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
