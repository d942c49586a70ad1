"""What CI installs: the llama extra (make test builds it), so the llama.cpp engine's tests run there, not skip."""

import importlib.util
import os

import pytest


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="outside CI the llama extra is optional")
def test_ci_has_llama_cpp_python():
    assert importlib.util.find_spec("llama_cpp") is not None, "make test installs '.[dev,llama]'"
