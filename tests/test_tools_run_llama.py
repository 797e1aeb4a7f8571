"""The main job's command line (tools/run_llama.py), run in this process on the default model."""

from __future__ import annotations

import pytest

from actors import ActorStartupError
from tools import run_llama

SMALL = ["--dataset", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--ignore-eos", "--show", "0"]


def test_the_main_job_reports_its_layout_and_tokens(capsys):
    result = run_llama.main(["--pp", "2", "--layer-split", "5", "3", "--dtype", "float32", *SMALL])
    assert result["layer_split"] == [5, 3] and result["dtype"] == "float32"
    assert result["output_tokens"] == 16 and result["prompt_tokens"] == 64
    assert "Throughput:" in capsys.readouterr().out


def test_a_layer_split_that_does_not_add_up_names_the_rank():
    with pytest.raises(ActorStartupError, match=r"rank \(pp=[01], tp=0\): layer_split=\[4, 3\] must .* summing to num_hidden_layers=8"):
        run_llama.main(["--pp", "2", "--layer-split", "4", "3", *SMALL])


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--num-prompts"])
def test_sizes_below_one_are_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_llama.parse_args([flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be an integer >= 1, got 0" in capsys.readouterr().err
