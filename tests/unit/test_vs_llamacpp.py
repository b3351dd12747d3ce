"""tools/bench/vs_llamacpp.py's pure parts: its options (--quantization reaches Baton only
when given, --quick), the requests it sends each server, and how it reads what the
children and servers answer. The comparison itself needs llama.cpp's venv and is not run
here."""

from __future__ import annotations

import json

import pytest

from baton.tools.bench.vs_llamacpp import (
    baton_llm_kwargs,
    baton_serve_flags,
    best_and_median,
    completion_body,
    completion_tokens,
    leading_agreement,
    llama_server_cmd,
    parse_args,
    read_result,
)


def test_quantization_reaches_baton_only_when_given():
    plain = parse_args(["--model", "m.gguf"])
    assert "quantization" not in baton_llm_kwargs(plain)
    assert "--quantization" not in baton_serve_flags(plain, 8000)
    quant = parse_args(["--model", "m.gguf", "--quantization", "gguf"])
    assert baton_llm_kwargs(quant)["quantization"] == "gguf"
    flags = baton_serve_flags(quant, 8000)
    assert flags[flags.index("--quantization") + 1] == "gguf"
    # llama.cpp reads the GGUF as it is, whatever Baton is told.
    assert "--quantization" not in " ".join(llama_server_cmd(quant, 8001))


def test_both_servers_get_the_same_model_and_thread_count():
    args = parse_args(["--model", "m.gguf", "--threads", "3"])
    flags = baton_serve_flags(args, 8000)
    assert flags[flags.index("--model") + 1] == "m.gguf"
    assert flags[flags.index("--threads") + 1] == "3"
    assert flags[flags.index("--http-port") + 1] == "8000"
    cmd = llama_server_cmd(args, 8001)
    for flag, value in (("--model", "m.gguf"), ("--n_threads", "3"),
                        ("--n_threads_batch", "3"), ("--port", "8001")):
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[cmd.index("-m") + 1] == "llama_cpp.server"
    assert cmd[cmd.index("--interrupt_requests") + 1] == "False"
    kw = baton_llm_kwargs(args)
    assert kw["model"] == "m.gguf" and kw["dtype"] == "bfloat16"


def test_quick_shrinks_every_part_and_defaults_are_the_issues():
    full = parse_args([])
    assert (full.tokens, full.threads, full.concurrency, full.w1_requests) == (128, 2, 64, None)
    quick = parse_args(["--quick"])
    assert quick.tokens < full.tokens and quick.rounds < full.rounds
    assert quick.w1_requests is not None and quick.w1_requests < 64
    assert quick.w1_output is not None and quick.concurrency <= quick.w1_requests


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--tokens", "1"], ["--rounds", "0"],
                                  ["--concurrency", "0"], ["--only", "w2"]])
def test_bad_options_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_each_server_is_asked_for_exactly_max_tokens_greedily():
    baton = completion_body("baton", "m", "hello", 128)
    llama = completion_body("llama.cpp", "m", "hello", 128)
    for body in (baton, llama):
        assert (body["prompt"], body["max_tokens"], body["temperature"]) == ("hello", 128, 0)
        assert "stream" not in body  # usage comes with the whole reply
    assert baton["ignore_eos"] is True and "min_tokens" not in baton
    assert llama["min_tokens"] == 128 and llama["repeat_penalty"] == 1.0
    assert "ignore_eos" not in llama


def test_child_lines_are_read_and_noise_is_skipped():
    line = json.dumps({"tok_s": 41.5, "tokens": [1, 2]})
    assert read_result(line + "\n") == {"tok_s": 41.5, "tokens": [1, 2]}
    for noise in ("llama_model_loader: loaded meta data", "{not json", "[1, 2]", ""):
        assert read_result(noise) is None


def test_usage_and_summaries():
    reply = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 9,
                                                    "completion_tokens": 128}}
    assert completion_tokens(reply) == 128
    assert best_and_median([40.0, 44.0, 41.0]) == (44.0, 41.0)
    assert leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert leading_agreement([1, 2], [1, 2, 3]) == 2
    assert leading_agreement([], [1]) == 0
