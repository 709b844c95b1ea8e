from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    # Tiny models on a shared 2-core machine: one intra-op thread avoids OpenMP oversubscription (10-40x faster).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
