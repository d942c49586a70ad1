import contextlib

import pytest
import torch

from specdraft.model.tiny import build_tiny_model


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # Tiny models gain nothing from threads, and on a loaded 2-core machine OpenMP spinning makes
    # multi-threaded forwards 5-20x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def packed_qwen3(tiny_qwen3_dir, tmp_path_factory):
    """The tiny Qwen3 packed by `specdraft pack` (QD04, default group size): its PackResult."""
    from specdraft.stages.pack import PackConfig, run_pack

    return run_pack(PackConfig(checkpoint=str(tiny_qwen3_dir),
                               out=str(tmp_path_factory.mktemp("packed") / "tiny-qwen3-packed")))


@pytest.fixture(scope="session")
def packed_dir(packed_qwen3):
    return packed_qwen3.out


@pytest.fixture
def packed_copy(packed_qwen3, tmp_path):
    """A copy of the packed dir a test may break."""
    import shutil

    return shutil.copytree(packed_qwen3.out, tmp_path / "copy")


@pytest.fixture(params=["qwen3", "llama"])
def tiny_model_dir(request, tiny_qwen3_dir, tiny_llama_dir):
    return {"qwen3": tiny_qwen3_dir, "llama": tiny_llama_dir}[request.param]


@pytest.fixture
def int4_kernel_calls():
    """``with int4_kernel_calls() as calls:`` records the arguments of every ``_weight_int4pack_mm_for_cpu``
    call inside the block (the kernel still runs): x is ``args[0]``, the packed codes ``args[1]``."""
    @contextlib.contextmanager
    def recording():
        calls, real = [], torch.ops.aten._weight_int4pack_mm_for_cpu
        torch.ops.aten._weight_int4pack_mm_for_cpu = lambda *args: calls.append(args) or real(*args)
        try:
            yield calls
        finally:
            torch.ops.aten._weight_int4pack_mm_for_cpu = real
    return recording


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip_gpu = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
