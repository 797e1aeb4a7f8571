"""tools/bench_throughput.py's engine switches: each flag turns off a real LLM option, in every tool that takes them."""

from __future__ import annotations

import argparse
import inspect

from scheduling import LLM
from tools import bench_throughput


def parser_with_switches() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench_throughput.add_engine_switches(parser)
    for name in ("--dtype", "--max-num-batched-tokens", "--layer-split", "--kv-mirror-mb"):
        parser.add_argument(name)
    return parser


def test_every_switch_turns_off_an_option_that_llm_takes_and_defaults_on():
    defaults = inspect.signature(LLM.__init__).parameters
    for flag, option, _ in bench_throughput.ENGINE_SWITCHES:
        assert defaults[option].default is True, option
        args = parser_with_switches().parse_args([flag])
        assert bench_throughput.switched_off(args) == {option: False}
    assert bench_throughput.switched_off(parser_with_switches().parse_args([])) == {}


def test_the_switches_reach_each_configuration_s_own_process_unchanged():
    flags = [flag for flag, _, _ in bench_throughput.ENGINE_SWITCHES]
    args = parser_with_switches().parse_args(["--dtype", "bfloat16", *flags])
    forwarded = bench_throughput._forwarded(args)
    assert forwarded == ["--dtype", "bfloat16", *flags]
    again = parser_with_switches().parse_args(forwarded)
    assert bench_throughput.switched_off(again) == bench_throughput.switched_off(args)
