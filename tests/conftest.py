import pytest

from specdraft.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(params=["qwen3", "llama"])
def tiny_model_dir(request, tiny_qwen3_dir, tiny_llama_dir):
    return {"qwen3": tiny_qwen3_dir, "llama": tiny_llama_dir}[request.param]


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
