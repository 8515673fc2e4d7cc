"""The pure parts of the load path: shard patterns and layouts (distload.loading.layout), the read
choice (each load format's choose, distload.loading.formats), and the file-list comparison (distload.loading.agreement)."""

from __future__ import annotations

import re

import pytest

from distload.errors import CheckpointError, ShardLayoutError
from distload.loading.agreement import mismatched_ranks
from distload.loading.choice import ReadChoice, ReadFacts
from distload.loading.formats import AUTO_CPU_BACKEND, FORMATS, LOAD_FORMATS
from distload.loading.layout import (
    DEFAULT_SHARD_PATTERN,
    find_shard_layout,
    pattern_regex,
    rank_glob,
    shard_files_for_rank,
)

P = DEFAULT_SHARD_PATTERN


def names(ranks, parts, pattern=P):
    return [pattern.format(rank=r, part=p) for r in ranks for p in parts]


# -- pattern_regex / rank_glob ------------------------------------------------------------------

def test_pattern_regex_default():
    regex = pattern_regex(P)
    match = regex.match("model-rank-12-part-3.safetensors")
    assert match and match["rank"] == "12" and match["part"] == "3"
    for bad in ["model-rank-1-part-3.safetensors.tmp", "xmodel-rank-1-part-3.safetensors",
                "model-rank-a-part-3.safetensors", "model-rank--part-3.safetensors",
                "model-rank-1-part-3.safetensorsx", "model-rank-1-part-3Xsafetensors",
                "model.safetensors"]:
        assert regex.match(bad) is None, bad


def test_pattern_regex_escapes_literals():
    regex = pattern_regex("w.{rank}+{part}(x).bin")
    assert regex.match("w.0+1(x).bin")
    assert regex.match("wa0+1(x).bin") is None
    # {part} is glob's *, as vLLM globs part="*": "+1" is a part name, a "/" never is.
    assert regex.match("w.0++1(x).bin")["part"] == "+1"
    assert regex.match("w.0+a/1(x).bin") is None


def test_pattern_regex_fields_in_any_order_and_repeated():
    regex = pattern_regex("part{part}_rank{rank}_r{rank}.st")
    match = regex.match("part07_rank2_r2.st")
    assert match["part"] == "07" and match["rank"] == "2"
    assert isinstance(regex, re.Pattern)


def test_rank_glob():
    assert rank_glob(P, 3) == "model-rank-3-part-*.safetensors"
    assert rank_glob("shard_{part}_of_{rank}.st", 0) == "shard_*_of_0.st"


# -- find_shard_layout -----------------------------------------------------------------------

def test_find_shard_layout_groups_by_rank_and_sorts_parts_numerically():
    listing = ["config.json", "model.safetensors"] + names([1, 0], [10, 2, 1, 0])
    layout = find_shard_layout(sorted(listing), P)
    assert layout.ranks == [0, 1]
    assert layout.saved_world_size == 2
    assert [part for part, _ in layout.parts_by_rank[0]] == ["0", "1", "2", "10"]
    assert [name for _, name in layout.parts_by_rank[1]] == [
        "model-rank-1-part-0.safetensors", "model-rank-1-part-1.safetensors",
        "model-rank-1-part-2.safetensors", "model-rank-1-part-10.safetensors"]


def test_find_shard_layout_custom_pattern():
    pattern = "tp{rank}-shard{part}.safetensors"
    listing = ["tp0-shard2.safetensors", "tp0-shard11.safetensors", "tp1-shard0.safetensors",
               "model-rank-0-part-0.safetensors", "tp2-shardX.safetensors"]
    layout = find_shard_layout(listing, pattern)
    assert layout.pattern == pattern
    assert layout.ranks == [0, 1, 2]  # tp2-shardX is rank 2's, as vLLM's glob tp2-shard* says
    assert layout.parts_by_rank[0] == [("2", "tp0-shard2.safetensors"), ("11", "tp0-shard11.safetensors")]
    assert layout.parts_by_rank[1] == [("0", "tp1-shard0.safetensors")]
    assert layout.parts_by_rank[2] == [("X", "tp2-shardX.safetensors")]


def test_find_shard_layout_nothing_matches():
    layout = find_shard_layout(["model-00001-of-00002.safetensors", "config.json"], P)
    assert layout.parts_by_rank == {}
    assert layout.ranks == []
    assert layout.saved_world_size == 0


def test_saved_world_size_counts_gaps():
    layout = find_shard_layout(names([0, 3], [0]), P)
    assert layout.ranks == [0, 3]
    assert layout.saved_world_size == 4


# -- shard_files_for_rank --------------------------------------------------------------------

def test_shard_files_for_rank_returns_this_ranks_files_in_part_order():
    layout = find_shard_layout(sorted(names([0, 1, 2], [0, 1, 2, 10])), P)
    assert shard_files_for_rank(layout, "/ckpt", 1, 3, "hint") == [
        "model-rank-1-part-0.safetensors", "model-rank-1-part-1.safetensors",
        "model-rank-1-part-2.safetensors", "model-rank-1-part-10.safetensors"]
    assert shard_files_for_rank(layout, "/ckpt", 2, 3, "hint") == names([2], [0, 1, 2, 10])


def test_missing_rank_vllm_style_message():
    layout = find_shard_layout(names([0, 1], [0, 1]), P)
    with pytest.raises(ShardLayoutError) as info:
        shard_files_for_rank(layout, "/ckpt", 3, 4, "it holds: ...")
    message = str(info.value)
    assert message.startswith(
        "Could not find checkpoint files '/ckpt/model-rank-3-part-*.safetensors', only "
        "pre-sharded checkpoints are currently supported!")
    assert "Files exist for ranks 0-1" in message
    assert "saved for 2 ranks, this job has 4" in message
    assert "start the job with 2 ranks or reshard the checkpoint for 4" in message
    assert isinstance(info.value, CheckpointError)


def test_missing_rank_in_the_middle_lists_ranges():
    layout = find_shard_layout(names([0, 1, 2, 4], [0]), P)
    with pytest.raises(ShardLayoutError) as info:
        shard_files_for_rank(layout, "/ckpt", 3, 5, "hint")
    message = str(info.value)
    assert "'/ckpt/model-rank-3-part-*.safetensors'" in message
    assert "Files exist for ranks 0-2, 4." in message
    assert "this job has" not in message  # saved world size 5 == job world size


def test_no_file_matches_the_pattern():
    layout = find_shard_layout(["model.safetensors", "config.json"], P)
    with pytest.raises(ShardLayoutError) as info:
        shard_files_for_rank(layout, "/ckpt", 0, 2, "it holds: config.json, model.safetensors")
    message = str(info.value)
    # No rank's files: the same message on every rank (the command line prints it once).
    assert "Could not find checkpoint files '/ckpt/model-rank-*-part-*.safetensors' for any rank" in message
    assert f"No file in /ckpt matches the pattern {P!r}" in message
    assert "it holds: config.json, model.safetensors" in message
    assert "'pattern'" in message and "--load-format safetensors" in message


def test_job_smaller_than_saved_world_size_errors():
    layout = find_shard_layout(names([0, 1, 2, 3], [0, 1]), P)
    for rank in (0, 1):
        with pytest.raises(ShardLayoutError) as info:
            shard_files_for_rank(layout, "/ckpt", rank, 2, "hint")
        message = str(info.value)
        assert "/ckpt holds shards for ranks 0-3" in message
        assert "saved for 4 ranks, this job has 2" in message
        assert "the shards of ranks 2-3 would never be loaded" in message


def test_job_larger_than_saved_world_size_fails_on_the_extra_ranks():
    layout = find_shard_layout(names([0, 1], [0]), P)
    assert shard_files_for_rank(layout, "/ckpt", 0, 3, "hint") == names([0], [0])
    with pytest.raises(ShardLayoutError, match="saved for 2 ranks, this job has 3"):
        shard_files_for_rank(layout, "/ckpt", 2, 3, "hint")


def test_duplicate_part_numbers():
    listing = ["model-rank-0-part-1.safetensors", "model-rank-0-part-01.safetensors",
               "model-rank-0-part-0.safetensors"]
    layout = find_shard_layout(listing, P)
    with pytest.raises(ShardLayoutError) as info:
        shard_files_for_rank(layout, "/ckpt", 0, 1, "hint")
    message = str(info.value)
    assert "rank 0 has two files for the same part number in /ckpt" in message
    assert "model-rank-0-part-1.safetensors" in message
    assert "model-rank-0-part-01.safetensors" in message


def test_custom_pattern_in_message():
    pattern = "tp{rank}-shard{part}.st"
    layout = find_shard_layout(["tp0-shard0.st"], pattern)
    with pytest.raises(ShardLayoutError, match=re.escape("'/ckpt/tp1-shard*.st'")):
        shard_files_for_rank(layout, "/ckpt", 1, 2, "hint")


# -- mismatched_ranks ------------------------------------------------------------------------

SIG = [("/c/a.safetensors", 100), ("/c/b.safetensors", 200)]


def test_mismatched_ranks_identical():
    assert mismatched_ranks([SIG]) == {}
    assert mismatched_ranks([SIG, list(SIG), list(SIG)]) == {}


def test_mismatched_ranks_extra_file():
    extra = SIG + [("/c/c.safetensors", 5)]
    assert mismatched_ranks([SIG, SIG, extra]) == {2: "has ['/c/c.safetensors'] that rank 0 lacks"}


def test_mismatched_ranks_missing_file():
    assert mismatched_ranks([SIG, SIG[:1]]) == {1: "lacks ['/c/b.safetensors'] that rank 0 has"}


def test_mismatched_ranks_different_size():
    other = [("/c/a.safetensors", 100), ("/c/b.safetensors", 199)]
    assert mismatched_ranks([SIG, other]) == {1: "sees other sizes for ['/c/b.safetensors']"}


def test_mismatched_ranks_different_order():
    assert mismatched_ranks([SIG, SIG[::-1]]) == {1: "lists the same files in another order"}


def test_mismatched_ranks_several_differences():
    other = [("/c/a.safetensors", 1), ("/c/z.safetensors", 2)]
    result = mismatched_ranks([SIG, SIG, other, SIG[::-1]])
    assert set(result) == {2, 3}
    assert result[2] == ("has ['/c/z.safetensors'] that rank 0 lacks; lacks ['/c/b.safetensors'] that "
                         "rank 0 has; sees other sizes for ['/c/a.safetensors']")
    assert result[3] == "lists the same files in another order"


# -- each format's choose --------------------------------------------------------------------

def choose_read(fmt, **facts):
    return FORMATS[fmt].choose(ReadFacts(**facts))


def choose(fmt, *, sharded=False, device="cpu", world=2, distributed=None, instant=False, device_data=True):
    return choose_read(fmt, sharded_layout_found=sharded, device_type=device, world_size=world,
                       distributed=distributed, instanttensor_installed=instant, device_data=device_data)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("instant", [False, True])
def test_explicit_formats_ignore_the_machine(sharded, device, instant):
    kw = dict(sharded=sharded, device=device, instant=instant)
    assert choose("safetensors", **kw) == ReadChoice(False, "safetensors", False)
    assert choose("sharded_state", **kw) == ReadChoice(True, "safetensors", False)
    assert choose("runai_streamer_sharded", **kw) == ReadChoice(True, "runai", False)
    assert choose("dummy", **kw) == ReadChoice(sharded, "dummy", False)


def test_runai_streamer_cooperative_only_when_distributed_and_many():
    assert choose("runai_streamer", world=2, distributed=True) == ReadChoice(False, "runai", True)
    assert choose("runai_streamer", world=2, distributed=False) == ReadChoice(False, "runai", False)
    assert choose("runai_streamer", world=1, distributed=True) == ReadChoice(False, "runai", False)
    assert choose("runai_streamer", world=8, distributed=True, device="cuda", sharded=True) == \
        ReadChoice(False, "runai", True)


def test_instanttensor_cooperative_with_many_ranks():
    # InstantTensor shares over the whole group it is handed: scope "job" (finding 17)
    assert choose("instanttensor", world=1, device="cuda") == ReadChoice(False, "instanttensor", False, "job")
    assert choose("instanttensor", world=4, device="cuda") == ReadChoice(False, "instanttensor", True, "job")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("instant", [False, True])
def test_auto_on_cpu(world, instant):
    assert AUTO_CPU_BACKEND == "pread"
    assert choose("auto", device="cpu", world=world, instant=instant) == ReadChoice(False, "pread", False)
    assert choose("auto", device="cpu", world=world, instant=instant, sharded=True) == \
        ReadChoice(True, "pread", False)


def test_auto_on_cuda_with_instanttensor():
    assert choose("auto", device="cuda", instant=True, world=1) == ReadChoice(False, "instanttensor", False, "job")
    assert choose("auto", device="cuda", instant=True, world=2) == ReadChoice(False, "instanttensor", True, "job")
    # A sharded layout is never read by InstantTensor: each rank streams its own files.
    assert choose("auto", device="cuda", instant=True, world=2, sharded=True) == ReadChoice(True, "runai", False)
    assert choose("auto", device="cuda", instant=True, world=1, sharded=True) == ReadChoice(True, "runai", False)


@pytest.mark.parametrize("instant", [False, True])
def test_auto_on_cuda_over_a_group_that_cannot_carry_device_tensors(instant):
    """vLLM's gloo cpu_group on GPUs (finding 3/4): neither InstantTensor nor Run:ai shares over it;
    distload's readers do, staged through the host, where a shared read is asked for."""
    kw = dict(device="cuda", instant=instant, world=2, device_data=False)
    assert choose("auto", **kw) == ReadChoice(False, "pread", False, "job")
    assert choose("auto", distributed="job", **kw) == ReadChoice(False, "pread", True, "job")
    assert choose("auto", **dict(kw, world=1)) == ReadChoice(False, "instanttensor" if instant else "runai", False,
                                                          "job" if instant else "node")


def test_auto_on_cuda_without_instanttensor():
    assert choose("auto", device="cuda", instant=False, world=1) == ReadChoice(False, "runai", False)
    assert choose("auto", device="cuda", instant=False, world=2) == ReadChoice(False, "runai", True)
    assert choose("auto", device="cuda", instant=False, world=2, sharded=True) == ReadChoice(True, "runai", False)


def test_auto_shares_local_reads_only_when_asked():
    """The page cache shares a node's local reads: cooperation is what the user asks for."""
    assert choose("auto", world=2) == ReadChoice(False, "pread", False)
    assert choose("auto", world=2, distributed=True) == ReadChoice(False, "pread", True, "node")
    assert choose("auto", world=2, distributed="job") == ReadChoice(False, "pread", True, "job")
    assert choose("auto", world=1, distributed="job") == ReadChoice(False, "pread", False)


def test_runai_streamer_takes_job_wide_sharing():
    assert choose("runai_streamer", world=4, distributed="job") == ReadChoice(False, "runai", True, "job")
    assert choose("runai_streamer", world=4, distributed="node") == ReadChoice(False, "runai", True, "node")


def remote(fmt="auto", **facts):
    base = dict(sharded_layout_found=False, device_type="cpu", world_size=4, distributed=None,
                instanttensor_installed=False, remote=True)
    return choose_read(fmt, **{**base, **facts})


def test_auto_on_an_object_store_shares_reads_job_wide():
    """Each byte leaves the store once per job: distload's own shared ranged reads on a CPU (on any
    group), Run:ai's job-wide mode for a GPU job on the default group."""
    assert remote() == ReadChoice(False, "ranged", True, "job")
    assert remote(distributed=True) == ReadChoice(False, "ranged", True, "node")
    assert remote(distributed=False) == ReadChoice(False, "runai", False)
    assert remote(device_type="cuda") == ReadChoice(False, "runai", True, "job")
    assert remote(whole_job=False) == ReadChoice(False, "ranged", True, "job")
    # Slices of a whole checkpoint (with replicas or without: TP ranks split the same tensors), and
    # shard files of a TP rank its replicas all need.
    assert remote(sliced=True, replicas=2) == ReadChoice(False, "ranged", True, "job")
    assert remote(sliced=True, replicas=1) == ReadChoice(False, "ranged", True, "job")
    assert remote(sliced=True, replicas=1, world_size=1) == ReadChoice(False, "ranged", False, "job")
    assert remote(sharded_layout_found=True, replicas=1) == ReadChoice(True, "runai", False)
    assert remote(sharded_layout_found=True, replicas=2) == ReadChoice(True, "ranged", True, "job")
    assert remote(sharded_layout_found=True, replicas=2, distributed=False) == ReadChoice(True, "runai", False)
    # Locally the same layouts share only when asked.
    assert remote(remote=False, sliced=True, replicas=2) == ReadChoice(False, "pread", False, "job")
    assert remote(remote=False, sliced=True, replicas=2, distributed="job") == ReadChoice(False, "pread", True, "job")
    assert remote(remote=False, sliced=True, replicas=1) == ReadChoice(False, "pread", False, "job")


def test_every_format_has_a_choice_and_unknown_is_a_programming_error():
    for fmt in LOAD_FORMATS:
        choice = choose(fmt, device="cuda", instant=True)
        assert choice.backend in {"safetensors", "runai", "instanttensor", "dummy"}
    with pytest.raises(KeyError, match="'pt'"):  # a name make_load_config refused has no entry
        choose("pt")


def test_auto_reads_an_object_store_cooperatively():
    """No page cache shares a node's downloads: a whole checkpoint on several ranks is read once
    per job; shards (without replicas) and a single rank are read alone."""
    common = dict(device_type="cpu", distributed=None, instanttensor_installed=False, remote=True)
    assert choose_read("auto", sharded_layout_found=False, world_size=2, **common) == \
        ReadChoice(False, "ranged", True, "job")
    assert choose_read("auto", sharded_layout_found=True, world_size=2, **common) == ReadChoice(True, "runai", False)
    assert choose_read("auto", sharded_layout_found=False, world_size=1, **common) == ReadChoice(False, "runai", False)
    assert choose_read("runai_streamer", sharded_layout_found=False, world_size=2, **common).shared is False
    # safetensors' reader needs a local file: on an object store the same tensors come by ranged GETs.
    assert choose_read("safetensors", sharded_layout_found=False, world_size=2, **common) == \
        ReadChoice(False, "ranged", False)
    assert choose_read("sharded_state", sharded_layout_found=True, world_size=2, **common) == \
        ReadChoice(True, "ranged", False)
    # InstantTensor reads local files only; a GPU job on an object store streams with Run:ai.
    gpu = dict(common, device_type="cuda", instanttensor_installed=True)
    assert choose_read("auto", sharded_layout_found=False, world_size=2, **gpu) == \
        ReadChoice(False, "runai", True, "job")


def test_a_rank_glob_matches_every_part_name_as_vllm_globs():
    """vLLM reads every file of pattern.format(rank=r, part="*"): a part that is not a number is a
    part too (read, after the numbered ones), never a file silently left out."""
    names = ["model-rank-0-part-0.safetensors", "model-rank-0-part-final.safetensors",
             "model-rank-0-part-1.safetensors", "model-rank-1-part-0.safetensors", "model-rank-0-part-0.safetensors.tmp"]
    layout = find_shard_layout(names, P)
    assert shard_files_for_rank(layout, "/ckpt", 0, 2, "") == [
        "model-rank-0-part-0.safetensors", "model-rank-0-part-1.safetensors", "model-rank-0-part-final.safetensors"]


def test_a_pattern_without_part_and_one_with_a_subfolder():
    layout = find_shard_layout(["model-rank-0.safetensors", "model-rank-1.safetensors"], "model-rank-{rank}.safetensors")
    assert layout.ranks == [0, 1] and shard_files_for_rank(layout, "/c", 1, 2, "") == ["model-rank-1.safetensors"]
    layout = find_shard_layout(["rank0/part-0.safetensors", "rank0/part-1.safetensors", "rank1/part-0.safetensors",
                                "rank0/sub/part-0.safetensors"], "rank{rank}/part-{part}.safetensors")
    assert shard_files_for_rank(layout, "/c", 0, 2, "") == ["rank0/part-0.safetensors", "rank0/part-1.safetensors"]


def test_any_depth_finds_shards_below_sub_prefixes():
    names = ["sub/model-rank-0-part-0.safetensors", "sub/deeper/model-rank-1-part-0.safetensors", "x.json"]
    assert find_shard_layout(names, P).ranks == []
    assert find_shard_layout(names, P, any_depth=True).ranks == [0, 1]
    # A name that merely ends like a shard is not one (vLLM's "*pattern" would take it).
    assert find_shard_layout(["xmodel-rank-0-part-0.safetensors"], P, any_depth=True).ranks == []


def test_ranks_reading_alone_agree_whatever_their_targets():
    """Issue 30, item 7: a rank whose reload targets are DTensors (slices) and one whose are not
    (whole) both read alone; they were refused as 'different readers', both described as 'pread
    (whole checkpoint)'. A read that is not shared has no scope, so they agree; choices that do
    differ are described differently."""
    from distload.loading.agreement import _describe

    sliced = choose_read("auto", sharded_layout_found=False, device_type="cpu", world_size=2, distributed=None,
                         instanttensor_installed=False, sliced=True)
    whole = choose("auto")
    assert sliced == whole == ReadChoice(False, "pread", False)
    different = [ReadChoice(False, "pread", False), ReadChoice(False, "pread", True, "job"),
                 ReadChoice(False, "pread", True, "node"), ReadChoice(True, "pread", False),
                 ReadChoice(False, "runai", False)]
    assert len({_describe(c) for c in different}) == len(different)
