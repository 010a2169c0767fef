"""A run's PYTORCH_CUDA_ALLOC_CONF (VerifyRequest.cuda_alloc_conf): the child process sees
it in its environment from its start, so before CUDA could initialise there; None
inherits the parent's setting; a malformed value is a one-line error in the caller."""

import pytest
from conftest import tiny_config

from planner.errors import PlannerInputError
from runners.isolation import run_in_child
from runners.request import CUDA_ALLOC_CONF_ENV, Mode, VerifyRequest

EXPANDABLE = "expandable_segments:True"


def request(**kwargs) -> VerifyRequest:
    # "raise" fails in the child before torch is imported: a real child process in about a second.
    return VerifyRequest(config=tiny_config("tiny-llama"), model_name="tiny-llama",
                         scenario={"task": "causal-lm", "batch_size": 2, "seq_len": 16}, mode=Mode.CPU,
                         inject_fault="raise", **kwargs)


def test_the_child_sees_the_requested_alloc_conf(monkeypatch):
    monkeypatch.setenv(CUDA_ALLOC_CONF_ENV, "expandable_segments:False")  # the request's value wins
    result = run_in_child(request(cuda_alloc_conf=EXPANDABLE), timeout_s=60)
    assert result["status"] == "failed" and "injected fault" in result["reason"]
    assert result["environment"]["cuda_alloc_conf"] == EXPANDABLE


def test_without_one_the_child_inherits_the_parents(monkeypatch):
    monkeypatch.delenv(CUDA_ALLOC_CONF_ENV, raising=False)
    assert run_in_child(request(), timeout_s=60)["environment"]["cuda_alloc_conf"] is None
    monkeypatch.setenv(CUDA_ALLOC_CONF_ENV, "max_split_size_mb:128")
    assert run_in_child(request(), timeout_s=60)["environment"]["cuda_alloc_conf"] == "max_split_size_mb:128"


def test_the_setting_crosses_the_process_boundary_and_is_checked():
    sent = request(cuda_alloc_conf=EXPANDABLE)
    assert VerifyRequest.from_json(sent.to_json()).cuda_alloc_conf == EXPANDABLE
    for bad in ("a\nb", "x" * 201, 3):
        with pytest.raises(PlannerInputError, match="cuda_alloc_conf"):
            request(cuda_alloc_conf=bad)


def test_a_runs_environment_names_its_alloc_conf_and_on_cuda_the_gpu(monkeypatch):
    import torch

    from runners.measure import environment

    monkeypatch.setenv(CUDA_ALLOC_CONF_ENV, EXPANDABLE)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in H100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    cuda = environment(Mode.CUDA)
    assert cuda["cuda_alloc_conf"] == EXPANDABLE and cuda["device"] == "Stand-in H100"
    assert cuda["compute_capability"] == [9, 0] and "cuda_version" in cuda
    assert environment(Mode.CPU)["cuda_alloc_conf"] == EXPANDABLE
