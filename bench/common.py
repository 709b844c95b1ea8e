"""Pieces the benchmark scripts share."""

import multiprocessing
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3.local_stack import free_port
from eagle3.server_process import server_process
from shared.lifecycle.schemas import JobRecord, JobSpec, ModelRecord


def bench_job(*, hidden_size: int, num_hidden_layers: int, vocab_size: int, aux_layer_ids: list[int]) -> JobRecord:
    """A job record for writing sample files outside a submitted job."""
    return JobRecord(
        job_id="bench", created_at="", spec=JobSpec(dataset_url="-"),
        model=ModelRecord(path="-", architecture="LlamaForCausalLM", num_hidden_layers=num_hidden_layers,
                          hidden_size=hidden_size, vocab_size=vocab_size, template_hash="-"),
        aux_layer_ids=aux_layer_ids, hidden_size=hidden_size, bytes_per_token=8 * hidden_size + 16, samples_total=0,
        samples_rejected=0, samples_truncated=0, tokens_total=0, loss_tokens_total=0, shards_total=0,
        projected_bytes=0, draft_vocab_size=32000, vocab_coverage=1.0, versions={},
    )  # fmt: skip


@contextmanager
def reference_server(
    model_dir: Path, *, shm_dir: Path, log: Path, device: str = "auto", env: dict[str, str] | None = None
) -> Iterator[str]:
    """The reference inference server as its own process, as the workers see it; `env` adds to its environment
    (CUDA_VISIBLE_DEVICES to pin it to one GPU)."""
    port = free_port()
    env = {
        "EAGLE3_MODEL_PATH": str(model_dir),
        "EAGLE3_INFERENCE_PORT": str(port),
        "EAGLE3_INFERENCE_DEVICE": device,
        "EAGLE3_SHM_DIR": str(shm_dir),
        **(env or {}),
    }
    argv = ["-m", "services.inference.reference"]
    with server_process(argv, url=f"http://127.0.0.1:{port}", log=log, env=env) as url:
        yield url


def in_processes(processes: int, work: Callable[[int], None]) -> float:
    """Seconds for `work(p)` run in P forked processes at once (a worker's prefork pool): the inputs are
    shared copy-on-write, and the clock starts when every process is ready."""
    if processes == 1:
        started = time.perf_counter()
        work(0)
        return time.perf_counter() - started
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes + 1)

    def run(p: int) -> None:
        barrier.wait()
        work(p)

    children = [context.Process(target=run, args=(p,)) for p in range(processes)]
    for child in children:
        child.start()
    barrier.wait()
    started = time.perf_counter()
    for child in children:
        child.join()
        assert child.exitcode == 0, f"benchmark process failed with exit code {child.exitcode}"
    return time.perf_counter() - started
