"""The shape the code promises: one public API, one exception tree, one layout rule, backends as
objects whose keys make the formats' keys, and no process-wide state outside distload.runtime."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest
import torch
from safetensors.torch import save_file

import distload
from distload.errors import DistloadError
from distload.loading.backends import BACKENDS, Backend
from distload.loading.formats import FORMATS, allowed_keys, make_load_config
from distload.loading.layout import DEFAULT_SHARD_PATTERN, detect_layout
from distload.loading.manifest import SAVING_MARKER
from distload.runtime import RUNTIME, Runtime

from conftest import every_dtype_state, plain_read, write_sharded, write_whole

PACKAGE = pathlib.Path(distload.__file__).parent

# What the README shows a user, by name: all of it importable from the top.
README_API = ["load", "iter_tensors", "WorkerGroup", "reload_into", "Destination", "WeightSync", "SyncChannel",
              "WeightSleeper", "save_sharded", "reshard", "inspect", "verify", "state_digest",
              "DistloadError", "ConfigError", "CheckpointError", "ShardLayoutError", "ObjectStoreError",
              "BackendUnavailableError", "GroupError", "RankFailedError", "ReloadError", "SyncError"]


# -- one public API, one exception tree --------------------------------------------------------

def test_the_public_api_is_all_there():
    assert set(README_API) <= set(distload.__all__)
    for name in distload.__all__:
        assert getattr(distload, name) is not None, name
    assert len(distload.__all__) == len(set(distload.__all__))


def test_every_error_is_a_distload_error_and_config_errors_are_value_errors():
    errors = [getattr(distload, name) for name in distload.__all__ if name.endswith("Error")]
    assert all(issubclass(e, DistloadError) for e in errors)
    assert issubclass(distload.ConfigError, ValueError)
    with pytest.raises(ValueError, match="unknown load format"):  # a vLLM user's except ValueError
        make_load_config("no-such-format")


def test_group_argument_is_a_worker_group_or_none(tmp_path):
    write_whole(str(tmp_path / "ck"), {"w": torch.ones(3)}, num_files=1)
    with pytest.raises(distload.ConfigError, match="group must be a distload.WorkerGroup"):
        distload.load(str(tmp_path / "ck"), group=object())
    assert torch.equal(distload.load(str(tmp_path / "ck"), group=None, device="cpu")["w"], torch.ones(3))
    # iter_tensors makes (and closes) its own group too.
    assert [name for name, _ in distload.iter_tensors(str(tmp_path / "ck"), device="cpu")] == ["w"]


# -- backends are objects; formats take their keys ---------------------------------------------

def test_every_backend_is_an_object_with_its_traits():
    assert set(BACKENDS) == {"safetensors", "pread", "ranged", "runai", "instanttensor", "dummy"}
    for name, backend in BACKENDS.items():
        assert isinstance(backend, Backend) and backend.name == name
        assert isinstance(backend.available(), bool)
    assert {n for n, b in BACKENDS.items() if b.creates_host_tensors} == {"pread", "ranged", "safetensors"}
    assert {n for n, b in BACKENDS.items() if not b.reads_object_stores} == {"pread", "safetensors", "instanttensor"}


def test_a_backend_key_becomes_a_key_of_every_format_that_reads_with_it(monkeypatch):
    class WithKnob(type(BACKENDS["safetensors"])):
        keys = {**type(BACKENDS["safetensors"]).keys, "knob": distload.config.check_bool}

    monkeypatch.setitem(BACKENDS, "safetensors", WithKnob())
    assert "knob" in allowed_keys("safetensors") and "knob" in allowed_keys("sharded_state")
    assert "knob" not in allowed_keys("auto")  # auto takes only the keys it names
    assert make_load_config("sharded_state", {"knob": True}).extra == {"knob": True}
    with pytest.raises(distload.ConfigError, match="'knob' must be a bool"):
        make_load_config("safetensors", {"knob": 1})


def test_every_format_reads_with_registered_backends():
    for fmt in FORMATS.values():
        assert fmt.backends and all(b in BACKENDS for b in fmt.backends), fmt.name


# -- one layout rule ---------------------------------------------------------------------------

def test_detect_layout_whole_sharded_by_name_and_by_manifest(tmp_path):
    write_whole(str(tmp_path / "whole"), every_dtype_state(), num_files=2)
    whole = detect_layout(str(tmp_path / "whole"))
    assert not whole.sharded and whole.pattern == DEFAULT_SHARD_PATTERN and whole.manifest is None
    write_sharded(str(tmp_path / "sh"), world_size=2)
    sharded = detect_layout(str(tmp_path / "sh"))
    assert sharded.sharded and sharded.saved_world_size == 2 and sharded.shards.ranks == [0, 1]
    assert sharded.rank_files(1, 2) == ["model-rank-1-part-0.safetensors", "model-rank-1-part-1.safetensors"]
    # Saved with another pattern: found from its manifest, and from the pattern when given.
    custom = "shard-{part}-of-rank-{rank}.safetensors"
    distload.reshard(str(tmp_path / "whole"), str(tmp_path / "custom"), 2, pattern=custom, sharding="replicate")
    by_manifest = detect_layout(str(tmp_path / "custom"))
    assert by_manifest.sharded and by_manifest.pattern == custom and by_manifest.manifest is not None
    os.unlink(tmp_path / "custom" / "distload.json")
    assert not detect_layout(str(tmp_path / "custom")).sharded  # the default pattern finds nothing
    assert detect_layout(str(tmp_path / "custom"), custom).shards.ranks == [0, 1]


def test_detect_layout_refuses_an_unfinished_save(tmp_path):
    write_sharded(str(tmp_path / "sh"), world_size=1)
    (tmp_path / "sh" / SAVING_MARKER).write_text("")
    with pytest.raises(distload.CheckpointError, match="the checkpoint is incomplete"):
        detect_layout(str(tmp_path / "sh"))


def test_every_caller_uses_the_same_rule_for_a_custom_pattern(tmp_path, capsys):
    """reshard refuses a sharded source saved with a custom pattern, inspect finds it, and loads
    it; inspect --pattern finds one without a manifest."""
    write_whole(str(tmp_path / "whole"), every_dtype_state(), num_files=2)
    custom = "w-{rank}-{part}.safetensors"
    distload.reshard(str(tmp_path / "whole"), str(tmp_path / "custom"), 1, pattern=custom, sharding="replicate")
    with pytest.raises(distload.CheckpointError, match=r"already a pre-sharded \(per-rank\) checkpoint"):
        distload.reshard(str(tmp_path / "custom"), str(tmp_path / "again"), 2)
    info = distload.inspect(str(tmp_path / "custom"))
    assert info["layout"] == "sharded" and info["pattern"] == custom and info["manifest"]
    os.unlink(tmp_path / "custom" / "distload.json")
    from distload.cli.main import main

    assert main(["inspect", str(tmp_path / "custom"), "--pattern", custom, "--json"]) == 0
    assert '"layout": "sharded"' in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "custom"), "--pattern", "no-fields.safetensors"]) == 1
    assert "--pattern must contain the field {rank}" in capsys.readouterr().err
    loaded = distload.load(str(tmp_path / "custom"), "sharded_state", {"pattern": custom}, device="cpu")
    want = plain_read([str(tmp_path / "custom" / custom.format(rank=0, part=0))])
    assert set(loaded) == set(want) and all(torch.equal(loaded[n], want[n]) for n in want)


def test_save_into_a_folder_holding_shards_is_refused(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, str(folder / "model-rank-0-part-0.safetensors"))
    with pytest.raises(distload.CheckpointError, match="already holds a pre-sharded checkpoint"):
        distload.save_sharded({"w": torch.ones(2)}, str(folder))


# -- no process-wide state outside distload.runtime --------------------------------------------

# Module-level names that are bound once at import and never rebound: registries and tables.
CONSTANT_TABLES = {"BACKENDS", "FORMATS", "STORES", "RUNTIME", "LOAD_FORMATS", "DTYPES", "DTYPE_CODES",
                   "BUILTIN_SPECS", "SPEC_ALIASES", "SECRET_VARIABLES", "_SECRET_PATTERNS", "_PATTERN",
                   "__all__", "IO_BACKENDS", "WEIGHT_SUFFIXES", "WEIGHT_INDEXES", "OBJECT_STORE_SCHEMES",
                   "SCHEMES", "_DENIED_CODES", "_LAYER_TENSORS", "log", "T", "DTYPE_NAMES", "PACKED",
                   "UNSUPPORTED_DTYPES", "ENGINES", "_QUANTIZATION", "_WHERE"}


def test_no_module_level_mutable_state_outside_the_runtime():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                offenders.append(f"{where}:{node.lineno}: global {', '.join(node.names)}")
        for node in tree.body:
            targets = []
            if isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
                value = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                targets, value = [node.target.id], node.value
            else:
                continue
            # Constants, tuples, arithmetic and type aliases (Union[...], Callable[...]) are immutable.
            literal = isinstance(value, (ast.Constant, ast.Tuple, ast.BinOp, ast.UnaryOp, ast.Attribute, ast.Subscript))
            for name in targets:
                if name not in CONSTANT_TABLES and not literal:
                    offenders.append(f"{where}:{node.lineno}: {name}")
    assert offenders == []


def test_runtime_reset_forgets_everything():
    runtime = Runtime()
    runtime.stores[("s3",)] = object()
    runtime.reachable_until[("h", 1)] = 1.0
    runtime.huge_page_slots, runtime.runai_store_scheme = 3, "s3"
    runtime.reset()
    assert (runtime.stores, runtime.reachable_until, runtime.huge_page_slots, runtime.runai_store_scheme) == (
        {}, {}, None, None)
    assert isinstance(RUNTIME, Runtime)


# -- review fixes: what a refactor must not lose ------------------------------------------------

def test_a_dropped_stream_closes_its_read_at_once(tmp_path, monkeypatch):
    """No reference cycle keeps a stream alive: dropping it ends the read (and tells the other
    ranks) now, not when the garbage collector happens to run."""
    import gc

    from distload.loading.backends import BackendRun

    closed = []

    class Recording(type(BACKENDS["pread"])):
        def read(self, request):
            run = super().read(request)

            def tensors():
                try:
                    yield from run.tensors()
                finally:
                    closed.append(True)

            return BackendRun(run.path).start(tensors())

    monkeypatch.setitem(BACKENDS, "pread", Recording())
    write_whole(str(tmp_path / "ck"), every_dtype_state(), num_files=1)
    with distload.WorkerGroup(device="cpu") as group:
        gc.disable()
        try:
            stream = distload.Loader(str(tmp_path / "ck"), "auto", group=group).stream()
            next(stream)
            del stream
            assert closed == [True]
        finally:
            gc.enable()


def test_subgroups_come_from_the_job_group():
    with distload.WorkerGroup(device="cpu") as job:  # one process: the group of rank 0
        sub = job.subgroup([0])
        assert (sub.rank, sub.world_size, sub.ranks, sub.is_world) == (0, 1, [0], True)
        with pytest.raises(distload.ConfigError, match=r"within \[0, 1\)"):
            job.subgroup([1])


def test_auto_on_a_subgroup_shares_with_distloads_readers_where_run_ai_cannot_cooperate():
    from distload.loading.choice import ReadFacts

    def choose_read(fmt, **facts):
        return FORMATS[fmt].choose(ReadFacts(**facts))

    facts = dict(sharded_layout_found=False, world_size=2, distributed=None,
                 instanttensor_installed=False, remote=True)
    assert choose_read("auto", **facts, device_type="cuda").backend == "runai"
    assert choose_read("auto", **facts, device_type="cuda", whole_job=False).backend == "ranged"
    assert choose_read("auto", **facts, device_type="cuda", whole_job=False).shared
    # An explicit request stays what it is (and Run:ai's preflight says why it cannot run).
    assert choose_read("runai_streamer", **{**facts, "distributed": True}, device_type="cpu",
                       whole_job=False).shared


def test_instanttensor_refuses_an_object_store_before_any_request(monkeypatch):
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on: any request would fail differently
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(distload.BackendUnavailableError, match="instanttensor reads local files only"):
        distload.load("s3://bucket/model", "instanttensor", device="cpu")
    assert time.monotonic() - start < 5


def test_the_runtime_environment_is_not_locked_while_a_read_streams(monkeypatch):
    import threading

    monkeypatch.delenv("DISTLOAD_TEST_A", raising=False)
    monkeypatch.delenv("DISTLOAD_TEST_B", raising=False)

    def streaming():
        with RUNTIME.environment({"DISTLOAD_TEST_A": "1"}):
            yield os.environ.get("DISTLOAD_TEST_A")

    suspended = streaming()
    assert next(suspended) == "1"
    seen = []
    other = threading.Thread(target=lambda: seen.append(_enter_and_read(RUNTIME, "DISTLOAD_TEST_B")))
    other.start()
    other.join(5)
    assert seen == ["2"], "another thread's read waited for the suspended one"
    closer = threading.Thread(target=suspended.close)  # a generator may be closed from any thread
    closer.start()
    closer.join(5)
    assert "DISTLOAD_TEST_A" not in os.environ and "DISTLOAD_TEST_B" not in os.environ


def _enter_and_read(runtime, name):
    with runtime.environment({name: "2"}):
        return os.environ.get(name)


@pytest.mark.parametrize("setting, probes", [(None, False), ("false", True), ("true", True)])
def test_s3_instance_metadata_follows_the_users_setting(monkeypatch, setting, probes):
    from distload.loading.stores.s3 import S3Store

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    if setting is None:
        monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    else:
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", setting)
    chain = S3Store()._credential_session().get_component("credential_provider")
    # With the user's own setting botocore decides ("true" disables the probe itself).
    assert any(p.METHOD == "iam-role" for p in chain.providers) is probes


# -- layering: the import direction of every area ---------------------------------------------

# Each area may import only the areas on lower floors (and itself). A new folder must be placed
# here, so that where it sits is decided, not drifted into.
FLOORS = [
    {"errors", "fileio", "tensor_io", "quiet_exit", "config", "runtime"},  # plumbing, top-level modules
    {"workers"},  # the worker group, its launch facts and heartbeats
    {"tp"},  # tensor parallelism as pure data
    {"loading"},  # the load path: the base every feature stands on
    {"checkpoints", "live"},  # checkpoints as files; live updates to a loaded model (peers: neither imports the other)
    {"vllm", "verl"},  # inside vLLM (and reshard for vLLM, made by its engine); verl's checkpoint engine
    {"cli"},  # the command line
    {"__init__", "__main__"},  # the package's face
]
# Within the plumbing: a lower module never imports a higher one.
PLUMBING_ORDER = ["errors", "tensor_io", "quiet_exit", "fileio", "config", "runtime"]


def _area(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "distload", module
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """The distload modules ``path`` imports at run time (imports under ``if TYPE_CHECKING:`` are
    annotations only and do not count)."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    module = ".".join(("distload",) + path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("distload")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name == "distload":  # from distload import quiet_exit: the names are modules
                found += [(node.lineno, f"distload.{alias.name}") for alias in node.names]
            elif name.startswith("distload."):
                found.append((node.lineno, name))
    return found


def test_every_area_imports_only_the_floors_below_it():
    floor_of = {area: level for level, areas in enumerate(FLOORS) for area in areas}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE)
        area = where.parts[0].removesuffix(".py")
        assert area in floor_of, f"{where}: distload/{area} is on no floor of tests/test_architecture.py"
        for line, name in _imports(path):
            target = _area(name)
            if target == area:
                continue
            assert target in floor_of, f"{where}:{line} imports {name}, on no floor"
            # Same floor: the plumbing's own order is checked below; any other pair are peers.
            if floor_of[target] > floor_of[area] or (floor_of[target] == floor_of[area] and floor_of[area] > 0):
                offenders.append(f"{where}:{line}: {area} (floor {floor_of[area]}) imports {name} "
                                 f"(floor {floor_of[target]})")
    assert offenders == []


def test_the_plumbing_imports_downwards_only():
    offenders = []
    for name in PLUMBING_ORDER:
        for line, imported in _imports(PACKAGE / f"{name}.py"):
            target = _area(imported)
            if target in PLUMBING_ORDER and PLUMBING_ORDER.index(target) >= PLUMBING_ORDER.index(name):
                offenders.append(f"{name}.py:{line} imports {imported}")
    assert offenders == []


def test_loading_parts_import_downwards_only():
    """Inside the load path, the readers' shared parts (stores, shared reads, the index) sit below
    the backends and the planner: a backend may use them, never the other way round."""
    below_backends = ["stores", "shared_reads", "index", "host_memory", "mapped", "residency", "report"]
    offenders = []
    for part in below_backends:
        paths = sorted((PACKAGE / "loading" / part).rglob("*.py")) if (PACKAGE / "loading" / part).is_dir() \
            else [PACKAGE / "loading" / f"{part}.py"]
        for path in paths:
            for line, name in _imports(path):
                if name.startswith(("distload.loading.backends", "distload.loading.loader",
                                    "distload.loading.planner", "distload.loading.agreement")):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert offenders == []


def test_the_import_checker_sees_relative_typing_and_package_imports(tmp_path, monkeypatch):
    """The rules above are only as good as the parser: each kind of import it must see (or skip)."""
    sample = PACKAGE / "loading" / "_architecture_probe.py"
    try:
        sample.write_text("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                          "import distload.live.sync\nfrom distload import runtime\nfrom . import index\n"
                          "from .backends import base\nif TYPE_CHECKING:\n    from distload.cli import main\n")
        assert [name for _, name in _imports(sample)] == [
            "distload.live.sync", "distload.runtime", "distload.loading", "distload.loading.backends"]
    finally:
        sample.unlink()


def test_the_top_level_holds_at_most_eight_modules_and_no_class_is_defined_twice():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    defined: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: where for name, where in defined.items() if len(where) > 1} == {}
