"""generate's sampling arguments are checked before any checkpoint is opened: one line each."""
import pytest
import torch

from k3train.cli import main
from k3train.errors import UsageError
from k3train.infer.generate import batch_prompts, resolve_cuda_graph, resolve_dtype


@pytest.mark.parametrize("flag, value, words", [
    ("--temperature", "nan", "expected a finite number >= 0"), ("--temperature", "inf", "expected a finite"),
    ("--temperature", "-1", "expected a finite"), ("--top-p", "0", "expected 0 < top-p <= 1"),
    ("--top-p", "nan", "expected 0 < top-p"), ("--max-new-tokens", "1000000000", "expected 1 to 100,000"),
    ("--max-new-tokens", "0", "expected 1 to"),
])
def test_bad_sampling_arguments_are_one_line(tmp_path, capsys, flag, value, words):
    missing = tmp_path / "no_such_run"
    assert main(["generate", "--checkpoint", str(missing), "--prompt", "hi", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err and "no_such_run" not in err


@pytest.mark.parametrize("args, words", [
    (["--batch", "0"], "--batch 0: expected 1 to 1,024 sequences"),
    (["--batch", "5000"], "--batch 5000: expected 1 to 1,024"),
    (["--prompt", "b", "--batch", "3"], "--batch 3 with 2 --prompt values"),
    (["--cuda-graph", "true", "--device", "cpu"], "--cuda-graph true needs a CUDA device, and this run decodes on cpu"),
])
def test_bad_batch_and_graph_arguments_are_one_line(tmp_path, capsys, args, words):
    assert main(["generate", "--checkpoint", str(tmp_path / "no_such_run"), "--prompt", "hi", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err


def test_batch_repeats_one_prompt_or_takes_one_sequence_per_prompt():

    assert batch_prompts(["a"], 3) == ["a", "a", "a"]
    assert batch_prompts(["a", "bc"], None) == ["a", "bc"] == batch_prompts(["a", "bc"], 2)
    assert batch_prompts(["a"], None) == ["a"]
    assert resolve_cuda_graph("auto", "cuda")[0] is True and resolve_cuda_graph("true", "cuda")[0] is True
    assert resolve_cuda_graph("auto", "cpu") == (False, "off (auto: cpu has no CUDA graphs)")
    assert resolve_cuda_graph("false", "cuda") == (False, "off (--cuda-graph false)")


def test_resolve_dtype():
    """auto decodes in bf16 on CUDA (as bench_decode measures) and fp32 on CPU; a named dtype wins."""
    assert resolve_dtype("auto", "cuda") is torch.bfloat16 and resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("fp32", "cuda") is torch.float32 and resolve_dtype("bf16", "cpu") is torch.bfloat16
    with pytest.raises(UsageError, match="--dtype fp16: expected auto, bf16 or fp32"):
        resolve_dtype("fp16", "cuda")
