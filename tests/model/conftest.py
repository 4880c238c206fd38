"""Shared set-up of the model tests."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The debug model is tiny: thread hand-offs cost more than they save on shared CPU runners.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
