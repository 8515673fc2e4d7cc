"""What a user coming from vLLM meets: vLLM's own words where distload matches them, sources
given as vLLM's users give them, and messages and help that say what to do."""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import subprocess

import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.cli.demo import shown_lines
from distload.cli.main import build_parser, main
from distload.loading.sources import check_source, source_string

from conftest import every_dtype_state, plain_read, write_whole

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_pathlib_sources_load_and_report_as_strings(tmp_path):
    paths = write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=2)
    with distload.WorkerGroup(device="cpu") as group:
        result = distload.Loader(tmp_path / "ck", "auto", group=group).load(gather=True, digest=True)
    want = plain_read(paths)
    assert set(result.state) == set(want) and all(torch.equal(result.state[n], want[n]) for n in want)
    assert result.report.source == str(tmp_path / "ck")
    json.dumps(result.report.to_json())  # a Path would not serialise
    assert distload.inspect(tmp_path / "ck")["source"] == str(tmp_path / "ck")
    report = distload.reshard(tmp_path / "ck", str(tmp_path / "tp1"), 1)
    assert len(report.files) == 1


@pytest.mark.parametrize("given, want", [("S3://bucket/model", "s3://bucket/model"),
                                         ("Gs://bucket/m", "gs://bucket/m"), ("AZ://c/m", "az://c/m"),
                                         ("/local/Path", "/local/Path")])
def test_object_store_schemes_in_any_case(given, want):
    assert source_string(given) == want
    if "://" in given:
        assert check_source(given) == want


def test_a_bad_source_type_says_what_a_source_is():
    with pytest.raises(distload.ConfigError, match="non-empty path, pathlib.Path or URI string"):
        check_source(42)


def test_header_metadata_is_readable(tmp_path, capsys):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "step": "7"})
    info = distload.inspect(str(tmp_path / "model.safetensors"))
    assert info["files"][0]["metadata"] == {"format": "pt", "step": "7"}
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"][0]["metadata"] == {"format": "pt", "step": "7"}
    assert main(["inspect", str(tmp_path)]) == 0
    assert "metadata: format=pt, step=7" in capsys.readouterr().out


def test_a_folder_of_pytorch_weights_says_how_to_convert(tmp_path):
    torch.save({"w": torch.ones(2)}, str(tmp_path / "pytorch_model.bin"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(distload.CheckpointError) as info:
        distload.load(str(tmp_path), "safetensors", device="cpu")
    message = str(info.value)
    assert "no .safetensors files in this folder" in message
    assert "distload reads safetensors only, and pytorch_model.bin is not one" in message
    assert "safetensors.torch.save_file" in message


def test_a_safetensors_folder_gets_no_conversion_hint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(distload.CheckpointError) as info:
        distload.load(str(tmp_path), "safetensors", device="cpu")
    assert "convert" not in str(info.value)


@pytest.mark.parametrize("typo, guess", [("runai-streamer", "runai_streamer"), ("sharded-state", "sharded_state"),
                                         ("safetensor", "safetensors"), ("instant_tensor", "instanttensor")])
def test_an_unknown_format_close_to_a_known_one(typo, guess):
    with pytest.raises(distload.ConfigError, match=f"did you mean '{guess}'"):
        distload.make_load_config(typo)


def test_an_unknown_format_far_from_every_one_gets_no_guess():
    with pytest.raises(distload.ConfigError) as info:
        distload.make_load_config("gguf")
    assert "did you mean" not in str(info.value) and "choose one of" in str(info.value)


def test_offline_commands_name_no_rank(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distload: error: ") and "rank" not in err
    (tmp_path / "distload.saving").write_text("")  # an unfinished save: verify refuses it
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distload: error: ") and "the checkpoint is incomplete" in err and "rank" not in err


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((name, a) for a in sub._actions if not isinstance(a, argparse._HelpAction))


def test_every_option_and_positional_has_help_without_markup(capsys):
    parser = build_parser()
    missing = [f"{cmd} {a.dest}" for cmd, a in _actions(parser) if not a.help]
    assert missing == []
    for text in [parser.format_help()] + [sub.format_help() for sub in
                                          next(a for a in parser._actions
                                               if isinstance(a, argparse._SubParsersAction)).choices.values()]:
        assert "``" not in text and ":func:" not in text, text


def test_reshard_script_refuses_to_guess_the_tensor_parallel_size(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TENSOR_PARALLEL_SIZE"}
    env["SLURM_JOB_ID"] = "1"  # as inside a job; it must stop before it runs anything
    result = subprocess.run(["bash", str(REPO / "launch/slurm/reshard.sbatch"), "/ckpt", "/out"],
                            capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 2
    assert "give the tensor-parallel size" in result.stderr


def test_the_demo_names_a_report_only_when_it_keeps_it():
    output = "distload: auto from /x on 2 rank(s)\n[distload rank 0] report written to /tmp/r.json\nnoise"
    assert shown_lines(output, reports_kept=True) == ["distload: auto from /x on 2 rank(s)",
                                                      "[distload rank 0] report written to /tmp/r.json"]
    assert shown_lines(output, reports_kept=False) == ["distload: auto from /x on 2 rank(s)"]


# -- issue 34: what a new user meets first ------------------------------------------------------

@pytest.mark.parametrize("typo, guess", [("concurency", "concurrency"), ("memory-limit", "memory_limit"),
                                         ("distributd", "distributed")])
def test_a_misspelt_extra_config_key_gets_a_guess(typo, guess):
    with pytest.raises(distload.ConfigError) as info:
        distload.make_load_config("runai_streamer", {typo: 1})
    message = str(info.value)
    assert f"Unexpected extra config keys ['{typo}']" in message
    assert f"'{typo}': did you mean '{guess}'?" in message
    assert "allowed keys: concurrency, distributed, memory_limit" in message


def test_a_key_far_from_every_allowed_one_gets_no_guess():
    with pytest.raises(distload.ConfigError) as info:
        distload.make_load_config("safetensors", {"chunk_size": 8})
    assert "did you mean" not in str(info.value)


def test_ranks_that_fail_the_same_way_share_one_line():
    error = distload.RankFailedError("loading", {0: "disk full", 1: "disk full", 2: "disk full", 5: "bad header"})
    assert str(error) == "loading failed on rank(s) 0, 1, 2, 5:\n  ranks 0-2: disk full\n  rank 5: bad header"
    from distload.errors import rank_list
    assert rank_list([3]) == "rank 3" and rank_list([0, 1]) == "ranks 0, 1"
    assert rank_list([7, 0, 1, 2, 3, 5]) == "ranks 0-3, 5, 7"


def test_log_level_goes_before_or_after_the_command(monkeypatch):
    from distload.cli.main import log_level

    parser = build_parser()
    assert parser.parse_args(["--log-level", "debug", "verify", "/x"]).log_level == "debug"
    assert parser.parse_args(["verify", "/x", "--log-level", "ERROR"]).log_level == "error"
    assert parser.parse_args(["verify", "/x"]).log_level is None
    assert log_level(None, {}) == logging.INFO
    assert log_level(None, {"DISTLOAD_LOG_LEVEL": "Debug"}) == logging.DEBUG
    assert log_level("error", {"DISTLOAD_LOG_LEVEL": "debug"}) == logging.ERROR  # the flag wins
    with pytest.raises(distload.ConfigError, match="DISTLOAD_LOG_LEVEL='verbose' is not a log level"):
        log_level(None, {"DISTLOAD_LOG_LEVEL": "verbose"})


def test_inspect_lists_every_tensor_unless_asked_for_a_summary(tmp_path, capsys):
    state = {"model.embed.weight": torch.zeros(4, 3, dtype=torch.bfloat16), "model.norm.weight": torch.ones(3),
             "scalar": torch.tensor(1.0)}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  tensors (name, dtype, shape), 3:" in out
    rows = [line.split() for line in out[out.index("  tensors (name, dtype, shape), 3:") + 1:]]
    assert rows == [["model.embed.weight", "BF16", "[4,", "3]"], ["model.norm.weight", "F32", "[3]"],
                    ["scalar", "F32", "[]"]]
    assert main(["inspect", str(tmp_path), "--summary"]) == 0
    summary = capsys.readouterr().out
    assert "tensors (name, dtype, shape)" not in summary and "model.norm.weight" not in summary
    assert "3 tensors" in summary
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    assert sorted((t["name"], t["dtype"], t["shape"]) for t in tensors) == [
        ("model.embed.weight", "BF16", [4, 3]), ("model.norm.weight", "F32", [3]), ("scalar", "F32", [])]


def test_argument_errors_name_every_rank_once_and_fill_torchruns_error_file(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank has the same command line, so every rank rejects it the same
    way: rank 0 prints it for all; each rank leaves it in torch's error file for the summary."""
    for rank in (0, 1):
        error_file = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert main(["load", str(tmp_path), "--load-format", "sharded-state"]) == 1
        err = capsys.readouterr().err
        line = ("distload: error on ranks 0, 1 (every rank): unknown load format 'sharded-state'; "
                "did you mean 'sharded_state'?")
        assert err.startswith(line) if rank == 0 else err == ""
        message = json.loads(error_file.read_text())["message"]
        assert message["message"].startswith(line) and "py_callstack" not in message["extraInfo"]


def test_precheck_is_the_ranks_own_check():
    from distload.cli.main import precheck

    assert precheck(["load", "/ckpt", "--load-format", "auto", "--model-loader-extra-config",
                     '{"distributed": "job"}']) == 0
    assert precheck(["load", "/ckpt", "--model-loader-extra-config", "{oops"]) == 1
    assert precheck(["load", "/ckpt", "--tensor-parallel-size", "0"]) == 1
    with pytest.raises(SystemExit) as info:  # argparse's own usage error
        precheck(["load"])
    assert info.value.code == 2


def test_the_demo_table_checks_every_format_times_none_and_says_where_its_folder_stays(tmp_path, capsys):
    """The demo's checkpoint is too small for timings to mean what the benchmarks measure: no
    seconds and no ratios, the benchmarks named instead; the folder its commands load stays, and
    the last line says where and how to remove it."""
    from distload.cli.demo import _print_table

    def report(path, digests):
        return {"ranks": [{"path": path, "digest": d} for d in digests], "total": {"seconds": 0.1}}

    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "model.safetensors").write_bytes(b"x" * 2**20)
    cases = [("whole", "/w", "safetensors", None), ("whole", "/w", "auto", '{"distributed": "job"}'),
             ("sharded", "/s", "sharded_state", None), ("whole", "/w", "dummy", None)]
    results = {"reports": [report("safetensors", ["a", "a"]), report("pread-shared", ["a", "a"]),
                           report("safetensors", ["b", "c"]), report("dummy", ["x", "y"])]}
    want = {"whole": ["a", "a"], "sharded": ["b", "c"]}
    assert _print_table(results, cases, want, 2, str(tmp_path), started=0.0) == 0
    text = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split() for line in text.splitlines()
            if line[:1].isalpha() and line.split()[1:2] in (["whole"], ["sharded"], ["distributed"])}
    assert rows[("safetensors", "whole")][-1] == "bit-identical"
    assert rows[("auto", "distributed")][-2:] == ["pread-shared", "bit-identical"]
    assert rows[("sharded_state", "sharded")][-1] == "bit-identical"
    assert rows[("dummy", "whole")][-2:] == ["dummy", "(random)"]
    assert "vs plain" not in text and "seconds" not in text
    assert "benchmarks/results/load.md" in text
    assert text.rstrip().endswith(f"the checkpoints stay in {tmp_path} (1 MiB: whole/, sharded/), for the commands "
                                  f"above; remove them with: rm -rf {tmp_path}")
