"""Load formats and their extra-config keys (distload.loading.formats, the backends' checks),
values (distload.config), and the environment a read applies (distload.runtime)."""

from __future__ import annotations

import os

import pytest

import torch

import distload
from distload.config import LoadConfig, parse_extra_config
from distload.errors import ConfigError
from distload.loading.backends import BACKENDS, ReadRequest
from distload.loading.backends.instanttensor import IO_BACKENDS as INSTANTTENSOR_BACKENDS
from distload.loading.formats import FORMATS, LOAD_FORMATS, allowed_keys, make_load_config
from distload.loading.index import CheckpointIndex
from distload.loading.layout import DEFAULT_SHARD_PATTERN
from distload.runtime import RUNTIME

from conftest import every_dtype_state, write_whole

EXPECTED_FORMATS = {"auto", "safetensors", "runai_streamer", "instanttensor", "sharded_state",
                    "runai_streamer_sharded", "dummy"}


# -- formats ---------------------------------------------------------------------------------

def test_load_formats_are_the_documented_set():
    assert set(LOAD_FORMATS) == EXPECTED_FORMATS
    assert len(LOAD_FORMATS) == len(EXPECTED_FORMATS)
    assert set(FORMATS) == EXPECTED_FORMATS


@pytest.mark.parametrize("fmt", sorted(EXPECTED_FORMATS))
def test_every_format_is_accepted(fmt):
    config = make_load_config(fmt)
    assert isinstance(config, LoadConfig)
    assert config.load_format == fmt
    assert dict(config.extra) == {}
    assert config.pattern is None  # the checkpoint's own (manifest), else DEFAULT_SHARD_PATTERN
    assert config.distributed is None  # not set: the format decides


@pytest.mark.parametrize("fmt", sorted(EXPECTED_FORMATS))
def test_format_is_lowered_and_stripped(fmt):
    assert make_load_config(fmt.upper()).load_format == fmt
    assert make_load_config(f"  {fmt.title()} ").load_format == fmt


def test_unknown_format_lists_the_formats():
    with pytest.raises(ConfigError) as info:
        make_load_config("pt")
    message = str(info.value)
    assert "unknown load format 'pt'" in message
    for fmt in LOAD_FORMATS:
        assert fmt in message


def test_non_string_format_is_rejected():
    with pytest.raises(ConfigError, match="load format must be a string"):
        make_load_config(None)  # type: ignore[arg-type]


# -- whitelist -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(EXPECTED_FORMATS))
def test_unknown_key_names_the_allowed_keys(fmt):
    with pytest.raises(ConfigError) as info:
        make_load_config(fmt, {"no_such_knob": 1})
    message = str(info.value)
    assert "no_such_knob" in message
    assert repr(fmt) in message
    allowed = allowed_keys(fmt)
    if allowed:
        assert "allowed keys: " + ", ".join(allowed) in message
    else:
        assert "allowed keys: none" in message


def test_allowed_keys_per_format():
    assert set(allowed_keys("runai_streamer")) == {"distributed", "concurrency", "memory_limit"}
    assert set(allowed_keys("runai_streamer_sharded")) == {"pattern", "concurrency", "memory_limit"}
    cache = {"cache_dir", "cache_max_gib"}  # the node cache: where distload's ranged reads may run
    assert set(allowed_keys("sharded_state")) == {"pattern", "huge_pages"} | cache
    assert set(allowed_keys("auto")) == {"pattern", "huge_pages", "concurrency", "distributed"} | cache
    assert set(allowed_keys("safetensors")) == {"huge_pages"} | cache
    assert set(allowed_keys("instanttensor")) == {
        "buffer_size", "chunk_size", "concurrency", "io_depth", "max_free_mem_usage", "backend"}


def test_distributed_on_sharded_runai_explains_why():
    with pytest.raises(ConfigError) as info:
        make_load_config("runai_streamer_sharded", {"distributed": True})
    message = str(info.value)
    assert "'distributed'" in message
    assert "each rank of a pre-sharded checkpoint reads different files" in message
    assert "silently exchange data" in message
    assert "allowed keys: concurrency, memory_limit, pattern" in message


@pytest.mark.parametrize("fmt, allowed", [("dummy", "none"), ("safetensors", "cache_dir, cache_max_gib, huge_pages")])
@pytest.mark.parametrize("key", ["distributed", "concurrency", "memory_limit", "pattern"])
def test_dummy_and_safetensors_accept_no_loader_keys(fmt, allowed, key):
    value = {"distributed": True, "concurrency": 2, "memory_limit": 0,
             "pattern": DEFAULT_SHARD_PATTERN}[key]
    with pytest.raises(ConfigError, match=f"allowed keys: {allowed}$"):
        make_load_config(fmt, {key: value})


def test_several_unknown_keys_are_all_named():
    with pytest.raises(ConfigError) as info:
        make_load_config("sharded_state", {"zeta": 1, "alpha": 2})
    assert "['alpha', 'zeta']" in str(info.value)


# -- values ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["runai_streamer", "auto"])
@pytest.mark.parametrize("value", [True, False, "node", "job"])
def test_distributed_takes_a_bool_or_a_scope(fmt, value):
    config = make_load_config(fmt, {"distributed": value})
    assert config.distributed is value or config.distributed == value


@pytest.mark.parametrize("value", [1, 0, "true", None, 1.0, "cluster"])
def test_distributed_must_be_a_bool_or_a_scope(value):
    with pytest.raises(ConfigError, match=r"'distributed' must be true .*\"node\", \"job\" .* or false, got"):
        make_load_config("runai_streamer", {"distributed": value})


@pytest.mark.parametrize("fmt", ["runai_streamer", "runai_streamer_sharded", "instanttensor"])
@pytest.mark.parametrize("value", [1, 4, 64])
def test_concurrency_positive_int_accepted(fmt, value):
    assert make_load_config(fmt, {"concurrency": value}).extra["concurrency"] == value


@pytest.mark.parametrize("fmt", ["runai_streamer", "runai_streamer_sharded", "instanttensor"])
@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, "4", None, True, False])
def test_concurrency_rejected(fmt, value):
    with pytest.raises(ConfigError) as info:
        make_load_config(fmt, {"concurrency": value})
    assert "'concurrency' must be a positive int" in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [-1, 0, 1, 1024, 2**40])
def test_memory_limit_accepted(value):
    assert make_load_config("runai_streamer", {"memory_limit": value}).extra["memory_limit"] == value
    assert make_load_config("runai_streamer_sharded", {"memory_limit": value}).extra["memory_limit"] == value


@pytest.mark.parametrize("value", [-2, -100, 1.5, -1.0, "5", True, None])
def test_memory_limit_rejected(value):
    with pytest.raises(ConfigError) as info:
        make_load_config("runai_streamer", {"memory_limit": value})
    assert "'memory_limit' must be an int >= -1" in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("pattern", [
    "model-rank-{rank}-part-{part}.safetensors",
    "shard_{part}_of_rank{rank}.safetensors",
    "r{rank}p{part}",
])
def test_pattern_accepted(pattern):
    for fmt in ("auto", "sharded_state", "runai_streamer_sharded"):
        assert make_load_config(fmt, {"pattern": pattern}).pattern == pattern


@pytest.mark.parametrize("pattern", [
    "model-{part}.safetensors",          # no rank
    "model.safetensors",
    "",
    7,
    None,
])
def test_pattern_needs_rank(pattern):
    with pytest.raises(ConfigError) as info:
        make_load_config("sharded_state", {"pattern": pattern})
    message = str(info.value)
    assert ("must contain the field {rank} (and {part} if it has parts)" in message
            or "must be a string" in message)
    assert DEFAULT_SHARD_PATTERN in message


@pytest.mark.parametrize("pattern", ["model-rank-{rank}.safetensors", "rank{rank}/part-{part}.safetensors",
                                     "tp/{rank}/model-{part}.safetensors"])
def test_loading_takes_vllms_patterns_saving_needs_a_part_and_a_file_name(pattern, tmp_path):
    """vLLM globs pattern.format(rank=r, part="*"): no {part}, or a subfolder, load; a save needs
    {part} (vLLM's saver would write every part over one file) and a plain name."""
    from distload.checkpoints.output import check_save_args

    assert make_load_config("sharded_state", {"pattern": pattern}).pattern == pattern
    with pytest.raises(ConfigError, match="--file-pattern"):
        check_save_args(str(tmp_path / "out"), pattern, 1 << 20)


@pytest.mark.parametrize("pattern", [
    "model-{rank}-{part}-{tp}.safetensors",
    "model-{rank}-{part}-{}.safetensors",
    "model-{rank}-{part}-{0}.safetensors",
    "model-{rank}-{part}-{rank!z}.safetensors",
    "model-{rank}-{part}-{.safetensors",
])
def test_pattern_bad_fields_rejected(pattern):
    with pytest.raises(ConfigError) as info:
        make_load_config("sharded_state", {"pattern": pattern})
    message = str(info.value)
    assert "no other field" in message or "is not a valid pattern" in message
    assert pattern in message


@pytest.mark.parametrize("pattern", [
    "model-{rank}-{part}-{rank.foo}.safetensors",
    "model-{rank}-{part}-{rank[0]}.safetensors",
])
def test_pattern_attribute_or_index_field_rejected(pattern):
    with pytest.raises(ConfigError):
        make_load_config("sharded_state", {"pattern": pattern})


@pytest.mark.parametrize("pattern", ["model-{{rank}}-{part}.safetensors", "model-{rank}-{part:05d}.safetensors"])
def test_pattern_escaped_braces_and_specs_rejected(pattern):
    with pytest.raises(ConfigError):
        make_load_config("sharded_state", {"pattern": pattern})


@pytest.mark.parametrize("pattern", ["/abs/{rank}-{part}", "../up/{rank}-{part}.safetensors"])
def test_pattern_stays_inside_the_checkpoint(pattern):
    with pytest.raises(ConfigError, match="must be a name inside the checkpoint folder"):
        make_load_config("sharded_state", {"pattern": pattern})


# -- instanttensor knobs ---------------------------------------------------------------------

@pytest.mark.parametrize("key", ["buffer_size", "chunk_size", "concurrency", "io_depth"])
def test_instanttensor_int_knobs(key):
    assert make_load_config("instanttensor", {key: 8}).extra[key] == 8
    for bad in (0, -3, 1.5, "8", True):
        with pytest.raises(ConfigError, match=f"'{key}' must be a positive int"):
            make_load_config("instanttensor", {key: bad})


@pytest.mark.parametrize("value", [1, 0.5, 1e-6, 1.0])
def test_instanttensor_max_free_mem_usage_accepted(value):
    assert make_load_config("instanttensor", {"max_free_mem_usage": value}).extra["max_free_mem_usage"] == value


@pytest.mark.parametrize("value", [0, -0.5, 1.01, 2, "0.5", True, None])
def test_instanttensor_max_free_mem_usage_rejected(value):
    with pytest.raises(ConfigError, match=r"'max_free_mem_usage' must be a number in \(0, 1\]"):
        make_load_config("instanttensor", {"max_free_mem_usage": value})


@pytest.mark.parametrize("value", ["URING", "aio", "uring,aio", " MMAP , buffered ", "CUFILE"])
def test_instanttensor_backend_accepted(value):
    assert make_load_config("instanttensor", {"backend": value}).extra["backend"] == value


@pytest.mark.parametrize("value", ["", "SPDK", "URING,", "uring,spdk", ["URING"], 1, None])
def test_instanttensor_backend_rejected(value):
    with pytest.raises(ConfigError) as info:
        make_load_config("instanttensor", {"backend": value})
    message = str(info.value)
    assert "'backend' must be one or more of" in message
    for name in INSTANTTENSOR_BACKENDS:
        assert name in message


def test_instanttensor_rejects_runai_keys():
    with pytest.raises(ConfigError, match="memory_limit"):
        make_load_config("instanttensor", {"memory_limit": 0})


# -- JSON ------------------------------------------------------------------------------------

def test_parse_extra_config_accepts_json_mapping_and_nothing():
    assert parse_extra_config(None) == {}
    assert parse_extra_config("") == {}
    assert parse_extra_config('{"concurrency": 4, "distributed": true}') == {"concurrency": 4, "distributed": True}
    source = {"concurrency": 4}
    parsed = parse_extra_config(source)
    assert parsed == source and parsed is not source


def test_make_load_config_from_json_text():
    config = make_load_config("runai_streamer", '{"distributed": true, "concurrency": 16, "memory_limit": -1}')
    assert dict(config.extra) == {"distributed": True, "concurrency": 16, "memory_limit": -1}
    assert config.distributed is True


@pytest.mark.parametrize("text", ["{concurrency: 4}", "{'concurrency': 4}", '{"concurrency": 4', "nope"])
def test_invalid_json_is_a_config_error(text):
    with pytest.raises(ConfigError) as info:
        make_load_config("runai_streamer", text)
    message = str(info.value)
    assert "--model-loader-extra-config is not valid JSON" in message
    assert repr(text) in message
    assert "pass an object such as" in message


@pytest.mark.parametrize("text,kind", [("[1, 2]", "list"), ("4", "int"), ('"x"', "str"), ("null", "NoneType"),
                                       ("true", "bool")])
def test_non_object_json_is_a_config_error(text, kind):
    with pytest.raises(ConfigError) as info:
        parse_extra_config(text)
    assert f"must be a JSON object, got {kind}" in str(info.value)


# -- nothing half-applied --------------------------------------------------------------------

def runai_environment(extra) -> dict[str, str]:
    """What Run:ai's backend asks for, for a local read with this extra config."""
    from distload.loading.choice import ReadChoice
    from distload.loading.plan import RankPlan

    plan = RankPlan("/ckpt", ReadChoice(False, "runai", False), CheckpointIndex(()))
    request = ReadRequest(index=CheckpointIndex(()), device=torch.device("cpu"), group=None,
                          options=BACKENDS["runai"].options(extra, plan))
    return BACKENDS["runai"].environment(request)


def test_one_bad_value_raises_before_environment_is_computed(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RUNAI_STREAMER_CONCURRENCY", raising=False)
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return {}

    monkeypatch.setattr(type(BACKENDS["runai"]), "environment", spy)
    folder = str(tmp_path / "ckpt")
    write_whole(folder, every_dtype_state(), num_files=1)
    before = dict(os.environ)

    with pytest.raises(ConfigError, match="memory_limit"):
        make_load_config("runai_streamer", {"concurrency": 4, "memory_limit": -5})
    with pytest.raises(ConfigError, match="memory_limit"):
        distload.load(folder, "runai_streamer", '{"concurrency": 4, "memory_limit": -5}', device="cpu")
    assert calls == []
    assert dict(os.environ) == before


def test_runai_environment_from_config():
    config = make_load_config("runai_streamer", {"concurrency": 4, "memory_limit": -1, "distributed": True})
    assert runai_environment(config.extra) == {
        "RUNAI_STREAMER_CONCURRENCY": "4", "RUNAI_STREAMER_MEMORY_LIMIT": "-1"}
    assert runai_environment({}) == {}
    assert runai_environment({"memory_limit": 0}) == {"RUNAI_STREAMER_MEMORY_LIMIT": "0"}


# -- endpoint bridging (Run:ai's reader reads AWS_ENDPOINT_URL; older setups set the legacy name) ---

def s3_bridge(monkeypatch, aws, legacy) -> dict[str, str]:
    from distload.loading.stores.s3 import S3Store

    for name, value in (("AWS_ENDPOINT_URL", aws), ("RUNAI_STREAMER_S3_ENDPOINT", legacy)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    env = S3Store().reader_environment()
    return {k: v for k, v in env.items() if k in ("AWS_ENDPOINT_URL", "RUNAI_STREAMER_S3_ENDPOINT")}


def test_endpoint_only_aws(monkeypatch):
    assert s3_bridge(monkeypatch, "http://minio:9000", None) == {"RUNAI_STREAMER_S3_ENDPOINT": "http://minio:9000"}


def test_endpoint_only_legacy(monkeypatch):
    assert s3_bridge(monkeypatch, None, "http://legacy:9000") == {"AWS_ENDPOINT_URL": "http://legacy:9000"}


def test_endpoint_both_set(monkeypatch):
    assert s3_bridge(monkeypatch, "http://a:1", "http://b:2") == {}


def test_endpoint_neither_set(monkeypatch):
    assert s3_bridge(monkeypatch, None, None) == {}


def test_endpoint_empty_value_counts_as_unset(monkeypatch):
    assert s3_bridge(monkeypatch, "", "http://y") == {"AWS_ENDPOINT_URL": "http://y"}


# -- the runtime's environment block ----------------------------------------------------------

ADDED = "DISTLOAD_TEST_ADDED_VAR"
CHANGED = "DISTLOAD_TEST_CHANGED_VAR"


def test_runtime_environment_sets_and_restores(monkeypatch):
    monkeypatch.delenv(ADDED, raising=False)
    monkeypatch.setenv(CHANGED, "old")
    before = dict(os.environ)
    with RUNTIME.environment({ADDED: "new", CHANGED: "changed"}):
        assert os.environ[ADDED] == "new"
        assert os.environ[CHANGED] == "changed"
    assert dict(os.environ) == before
    assert ADDED not in os.environ
    assert os.environ[CHANGED] == "old"


def test_runtime_environment_restores_when_body_raises(monkeypatch):
    monkeypatch.delenv(ADDED, raising=False)
    monkeypatch.setenv(CHANGED, "old")
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="boom"):
        with RUNTIME.environment({ADDED: "new", CHANGED: "changed"}):
            assert os.environ[ADDED] == "new"
            raise RuntimeError("boom")
    assert dict(os.environ) == before


def test_runtime_environment_restores_after_body_touches_keys(monkeypatch):
    monkeypatch.delenv(ADDED, raising=False)
    monkeypatch.setenv(CHANGED, "old")
    before = dict(os.environ)
    with RUNTIME.environment({ADDED: "new", CHANGED: "changed"}):
        del os.environ[ADDED]
        os.environ[CHANGED] = "body"
    assert dict(os.environ) == before


def test_runtime_environment_empty_changes_is_a_no_op():
    before = dict(os.environ)
    with RUNTIME.environment({}):
        assert dict(os.environ) == before
    assert dict(os.environ) == before
