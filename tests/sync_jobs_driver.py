"""One side of a two-job weight-sync test (tests/test_sync_jobs.py), each rank one process with
its rank's variables (dist_helpers.Job: as srun or torchrun start them; the job's store at
MASTER_PORT, which names the job)::

    python tests/sync_jobs_driver.py SCENARIO ROLE tcp://HOST:PORT OUT [ARGS...]

Each rank writes what it saw to ``OUT/ROLE<rank>.json`` (also when it fails: then with the
traceback under ``"crash"``, and the job exits 1). Values come from seeds, so every rank of
either job can recompute what a tensor of a version must hold, bit for bit. The channel is made
from the launch environment alone (rank and size are this job's); no default group is created.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import traceback
import zlib

import torch

import distload
import distload.live.channel as channel_module
from distload.live import handoff
from distload.errors import SyncError
from distload.live.channel import SyncChannel

TIMEOUT_S = 60.0

# -- values -------------------------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def mixed_shapes() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every dtype, a tensor bigger than a bucket, one sent straight from tensor to tensor, a 0-d
    and an empty tensor (about 5 MiB)."""
    shapes = {f"layers.{i}.{str(d).split('.')[-1]}": ((33 + i, 17 + i), d) for i, d in enumerate(DTYPES)}
    shapes["big"] = ((512, 512), torch.float32)  # 1 MiB: alone in its bucket
    shapes["huge"] = ((1024, 1024), torch.float32)  # 4 MiB: DIRECT_BYTES, no packing copy
    shapes["scalar"] = ((), torch.float64)
    shapes["empty"] = ((0, 7), torch.bfloat16)
    for i in range(6):
        shapes[f"tail.{i}"] = ((64, 96), torch.bfloat16)
    return shapes


def value(name: str, shape: tuple[int, ...], dtype: torch.dtype, version: int) -> torch.Tensor:
    """Version ``version`` of tensor ``name``: a function of (name, version) only."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}@{version}".encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 8).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -2**31), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)


def state_of(shapes, version: int, names=None) -> dict[str, torch.Tensor]:
    return {n: value(n, s, d, version) for n, (s, d) in shapes.items() if names is None or n in names}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def untracked(t: torch.Tensor):
    """A contiguous bf16 tensor's memory as a numpy int16 array: writes through it leave torch's
    version counter as it was."""
    return t.detach().view(torch.int16).reshape(-1).numpy()


def digest(state) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # A copy: a numpy view of a tensor would make its storage non-resizable for good.
        h.update(raw(t).clone().numpy().tobytes())
    return h.hexdigest()


def exact(target, expected) -> bool:
    return set(target) == set(expected) and all(
        target[n].dtype == expected[n].dtype and tuple(target[n].shape) == tuple(expected[n].shape)
        and torch.equal(raw(target[n]), raw(expected[n])) for n in expected)


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def stats_row(stats) -> dict:
    return {"version": stats.version, "nbytes": stats.nbytes, "num_tensors": stats.num_tensors,
            "num_buckets": stats.num_buckets, "wire_bytes": stats.wire_bytes, "verified": stats.verified,
            "delta": stats.delta, "seconds": stats.seconds, "transport": stats.transport}


def session_id(ch: SyncChannel):
    """The channel's current session (private: the tests check that a refusal keeps it)."""
    record = getattr(getattr(ch, "_session", None), "record", None)
    return getattr(record, "id", None)


def open_channel(role: str, address: str, **kwargs) -> SyncChannel:
    return SyncChannel(address, role, device="cpu", timeout_s=TIMEOUT_S, **kwargs)


# -- scenarios ----------------------------------------------------------------------------------

def full(role, address, result, args):
    """Whole tensors, 3 versions, small buckets; the same versions over a second channel at
    ``args[0]`` forced onto the socket (this one, on one host, hands off through shared memory)."""
    shapes = mixed_shapes()
    with open_channel(role, address, bucket_bytes=64 * 1024) as ch, \
            open_channel(role, args[0], bucket_bytes=64 * 1024, transport="socket") as sock:
        if role == "trainer":
            for version in (1, 2, 3):
                state = state_of(shapes, version)
                stats = ch.push(state, version)
                result.setdefault("pushes", []).append(
                    {**stats_row(stats), "digest": digest(state), "state_bytes": nbytes(state)})
                result.setdefault("socket", []).append(stats_row(sock.push(state, version)))
        else:
            target = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
            other = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
            pointers = {n: t.data_ptr() for n, t in target.items()}
            result["target_bytes"] = nbytes(target)
            for version in (1, 2, 3):
                stats = ch.receive(target)
                result.setdefault("receives", []).append(
                    {**stats_row(stats), "channel_version": ch.version, "consistent": ch.consistent,
                     "digest": digest(target), "exact": exact(target, state_of(shapes, version)),
                     "in_place": all(target[n].data_ptr() == p for n, p in pointers.items())})
                result.setdefault("socket", []).append(
                    {**stats_row(sock.receive(other)), "exact": exact(other, state_of(shapes, version))})
        result["held_open"] = segments_held()
    import gc

    gc.collect()  # the maps go with their last view
    result["held_closed"] = segments_held()


def two_trainers(role, address, result, args):
    """Each trainer rank pushes the names at its own index parity; one receiver takes all."""
    shapes = mixed_shapes()
    names = sorted(shapes)
    with open_channel(role, address, bucket_bytes=128 * 1024) as ch:
        if role == "trainer":
            mine = set(names[ch.rank::ch.size])
            result["names"] = sorted(mine)
            for version in (1, 2):
                state = state_of(shapes, version, mine)
                stats = ch.push(state, version)
                result.setdefault("pushes", []).append({**stats_row(stats), "state_bytes": nbytes(state)})
        else:
            target = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
            pointers = {n: t.data_ptr() for n, t in target.items()}
            result["target_bytes"] = nbytes(target)
            for version in (1, 2):
                stats = ch.receive(target)
                result.setdefault("receives", []).append(
                    {**stats_row(stats), "channel_version": ch.version,
                     "exact": exact(target, state_of(shapes, version)),
                     "in_place": all(target[n].data_ptr() == p for n, p in pointers.items())})


# A small Llama: 4 heads of 32, 2 KV heads; a vocabulary of 16500 rows (not a multiple of 64: padded
# to 16512, 8256 rows a rank) makes embed_tokens and lm_head 4 MiB each: TP rank 0's rows are one
# run of bytes (sent straight into its tensor), TP rank 1's end in 12 padding rows (packed).
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 320,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
                "vocab_size": 16500, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def llama_shapes() -> dict[str, tuple[int, ...]]:
    c = LLAMA_CONFIG
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def llama_slice_shapes(tp: int) -> dict[str, tuple[int, ...]]:
    """What one TP rank of vLLM holds, worked out here by hand (not with distload's slicing):
    vocabulary padded to a multiple of 64 then split by rows, q/k/v/gate/up split by rows
    (whole heads), o/down split by columns, norms whole."""
    c = LLAMA_CONFIG
    padded = -(-c["vocab_size"] // 64) * 64
    out = {}
    for name, shape in llama_shapes().items():
        if "embed_tokens" in name or name == "lm_head.weight":
            out[name] = (padded // tp, shape[1])
        elif any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            out[name] = (shape[0] // tp, shape[1])
        elif "o_proj" in name or "down_proj" in name:
            out[name] = (shape[0], shape[1] // tp)
        else:
            out[name] = shape
    return out


def llama_state(version: int) -> dict[str, torch.Tensor]:
    return {n: value(n, s, torch.bfloat16, version) for n, s in llama_shapes().items()}


def sliced(role, address, result, args):
    """The trainer pushes the checkpoint in ``args[0]``; inference ranks keep TP slices."""
    from safetensors.torch import load_file, save_file

    tp = int(args[1])
    if role == "trainer":
        state = {}
        for path in sorted(glob.glob(os.path.join(args[0], "*.safetensors"))):
            state.update(load_file(path))
        with open_channel(role, address, bucket_bytes=256 * 1024) as ch:
            stats = ch.push(state, 1)
            result["pushes"] = [{**stats_row(stats), "state_bytes": nbytes(state)}]
        return
    model_config = {k: LLAMA_CONFIG[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    with open_channel(role, address, tensor_parallel_size=tp, sharding="decoder",
                      model_config=model_config) as ch:
        # Not zeros: a padded vocabulary row must be written (as zeros) too.
        target = {n: torch.full(s, 7.0, dtype=torch.bfloat16) for n, s in llama_slice_shapes(tp).items()}
        pointers = {n: t.data_ptr() for n, t in target.items()}
        stats = ch.receive(target)
        result["receives"] = [{**stats_row(stats), "channel_version": ch.version,
                               "in_place": all(target[n].data_ptr() == p for n, p in pointers.items())}]
        result["target_bytes"] = nbytes(target)
        save_file(target, os.path.join(result["out"], f"received{ch.rank}.safetensors"))


def segments_held() -> dict[str, int]:
    """This process's hold on same-host segments: open files, mappings, and files of its own
    still named in /dev/shm (a trainer's segment file carries its pid)."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += handoff.PREFIX in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum(handoff.PREFIX in line for line in f)
    named = glob.glob(os.path.join(handoff.SHM_DIR, f"{handoff.PREFIX}*-{os.getpid()}-*"))
    return {"fds": fds, "maps": maps, "named": len(named)}


MISFIT_SHAPES = {f"w{i:02d}": ((16, 32), torch.float32) for i in range(12)}


def misfit(role, address, result, args):
    """v1 fits; v2: inference rank 1 has one tensor of another shape; v3: ten; v4 fits again."""
    shapes = MISFIT_SHAPES
    with open_channel(role, address, bucket_bytes=8 * 1024) as ch:
        if role == "trainer":
            for version in (1, 2, 3, 4):
                try:
                    stats = ch.push(state_of(shapes, version), version)
                    row = stats_row(stats)
                except SyncError as exc:
                    row = {"version": version, "error": str(exc)}
                row["session"] = session_id(ch)
                result.setdefault("pushes", []).append(row)
            return
        target = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
        for version in (1, 2, 3, 4):
            into = dict(target)
            if ch.rank == 1 and version == 2:
                into["w03"] = torch.zeros(15, 32)
            if ch.rank == 1 and version == 3:
                for i in range(10):
                    into[f"w{i:02d}"] = torch.zeros(32, 16)
            before = {n: t.clone() for n, t in into.items()}
            try:
                stats = ch.receive(into)
                row = stats_row(stats)
            except SyncError as exc:
                row = {"version": version, "error": str(exc), "last_error": ch.last_error}
            row.update(channel_version=ch.version, consistent=ch.consistent, session=session_id(ch),
                       unchanged=all(torch.equal(before[n], into[n]) for n in into),
                       exact=exact(target, state_of(shapes, version)))
            result.setdefault("receives", []).append(row)


def verify(role, address, result, args):
    """Only the inference side asks for verification. v1 clean; v2: on every receiver, a byte of
    the second packed bucket is flipped as it lands, before the receiver sums it (what a faulty
    transport would deliver); v3 clean again (a new session); v4: the checksum the trainer makes of
    a tensor that goes straight from tensor to tensor is wrong; v5 clean."""
    shapes = {f"w{i:02d}": ((64, 64), torch.float32) for i in range(8)}  # 16 KiB each: 2 a bucket
    shapes["huge"] = ((1024, 1024), torch.float32)  # 4 MiB: sent directly, from the tensor itself
    real_checksum = channel_module.checksum
    # Full updates (a delta's own checks are the delta scenario's); only the inference side asks.
    # On the socket: a faulty transport is a socket's. Handed off through shared memory, a receiver
    # reads the very bytes the trainer sums (while they go), and both receivers of one place the
    # same ones: a byte flipped there is the trainer's memory changed, which the sum may then see.
    with open_channel(role, address, bucket_bytes=32 * 1024, verify=(role == "inference"), delta=False,
                      transport="socket") as ch:
        if role == "trainer":
            for version in (1, 2, 3, 4, 5):
                summed = []

                def wrong_checksum(data, key):
                    summed.append(data.numel())
                    return real_checksum(data, key) + (data.numel() == 4 * 1024 * 1024)  # the direct bucket's only

                channel_module.checksum = wrong_checksum if version == 4 else real_checksum
                try:
                    stats = ch.push(state_of(shapes, version), version)
                    row = stats_row(stats)
                except SyncError as exc:
                    row = {"version": version, "error": str(exc)}
                finally:
                    channel_module.checksum = real_checksum
                row.update(summed=summed)
                result.setdefault("pushes", []).append(row)
            return
        target = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
        for version in (1, 2, 3, 4, 5):
            landed = []

            def corrupting_checksum(frame, key):
                landed.append(frame.numel())
                if len(landed) == 2:  # the second bucket, as it arrived: one byte differs from the sent one
                    frame[frame.numel() // 3] ^= 0x5A
                return real_checksum(frame, key)

            channel_module.checksum = corrupting_checksum if version == 2 else real_checksum
            try:
                stats = ch.receive(target)
                row = stats_row(stats)
            except SyncError as exc:
                row = {"version": version, "error": str(exc), "last_error": ch.last_error}
            finally:
                channel_module.checksum = real_checksum
            row.update(channel_version=ch.version, consistent=ch.consistent, corrupted=len(landed) >= 2,
                       exact=exact(target, state_of(shapes, version)),
                       holds_its_version=exact(target, state_of(shapes, ch.version)))
            result.setdefault("receives", []).append(row)


def sleep(role, address, result, args):
    """v1; inference rank 1 sleeps (level 1): v2 refused everywhere; wake: v1 back; sleep level
    2 and wake: zeros; v2 again arrives whole."""
    shapes = {f"w{i:02d}": ((48, 40), torch.bfloat16) for i in range(6)}
    shapes["ids"] = ((100,), torch.int32)
    with open_channel(role, address, bucket_bytes=8 * 1024) as ch:
        if role == "trainer":
            for version in (1, 2, 2):
                try:
                    stats = ch.push(state_of(shapes, version), version)
                    row = stats_row(stats)
                except SyncError as exc:
                    row = {"version": version, "error": str(exc)}
                result.setdefault("pushes", []).append(row)
            return
        target = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
        stats = ch.receive(target)
        result["v1"] = {**stats_row(stats), "digest": digest(target),
                        "exact": exact(target, state_of(shapes, 1))}
        sleeper = distload.WeightSleeper(target)
        if ch.rank == 1:
            result["released"] = sleeper.sleep(level=1)
            result["storage_bytes_asleep"] = sum(t.untyped_storage().nbytes() for t in target.values())
        before = None if sleeper.asleep else {n: t.clone() for n, t in target.items()}
        try:
            ch.receive(target)
            result["asleep_receive"] = {"error": None}
        except SyncError as exc:
            result["asleep_receive"] = {"error": str(exc), "version": ch.version, "consistent": ch.consistent}
        if before is not None:
            result["asleep_receive"]["unchanged"] = all(torch.equal(before[n], target[n]) for n in target)
        if ch.rank == 1:
            sleeper.wake()
            result["woken_digest"] = digest(target)
            sleeper.sleep(level=2)
            sleeper.wake()
            result["level2_zeros"] = all(not raw(t).any() for t in target.values())
        stats = ch.receive(target)
        result["v2"] = {**stats_row(stats), "channel_version": ch.version, "digest": digest(target),
                        "exact": exact(target, state_of(shapes, 2))}


def _trainer_model(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """fp32 master weights of the Llama shapes, an AdamW over them, and fixed inputs for a loss."""
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for n, s in llama_shapes().items()}
    inputs = {n: torch.randn(s[-1], 4, generator=gen) for n, s in llama_shapes().items()}
    return params, torch.optim.AdamW(params.values(), lr=1e-5, weight_decay=0.01), inputs


def train_step(params, optimizer, inputs, lr: float) -> dict[str, torch.Tensor]:
    """One real optimizer step (autograd, AdamW) on a loss over every weight; the bf16 state the
    inference side serves."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    loss = sum(((p @ inputs[n]) ** 2).mean() if p.dim() == 2 else ((p - 1) ** 2).mean() for n, p in params.items())
    loss.backward()
    optimizer.step()
    return bf16_state(params)


def bf16_state(params) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in params.items()}


# The delta scenario, as (version, learning rate of the step before it or None: the same state
# pushed again, what an inference rank does to its tensors before receiving it).
# (After lr 1e-2 most tensors' compares give up: they go whole once more at version 4, their
# copies refreshed, and are patched again from version 5 on.)
# lr 2e-7 changes about 1.1% of the bf16 elements a step (1e-6: 4.2%, which on one host goes whole:
# docs/delta-sync.md, "On one host the margin is 32").
DELTA_STEPS = [(1, None, None), (2, 2e-7, None), (3, 1e-2, None), (4, 2e-7, None), (5, 2e-7, "drift-1"),
               (5, None, None), (6, 2e-7, "move-0"), (7, 2e-7, "fail-0"), (7, None, None), (8, None, "flip-1"),
               (8, None, None), (9, 2e-7, "restart"), (10, 2e-7, None), (11, 2e-7, "rewrite-0")]


def delta(role, address, result, args):
    """Real AdamW steps pushed as deltas to TP 2 inference ranks, bit for bit, with receivers whose
    base drifts (at changed positions: the patch sums; elsewhere: the audit), a tensor that moves,
    and a receiver that fails mid-update (every change undone); each followed by a full update."""
    from safetensors.torch import load_file, save_file

    out = result["out"]
    if role == "trainer":
        params, optimizer, inputs = _trainer_model()
        state = bf16_state(params)
        ch = open_channel(role, address, bucket_bytes=256 * 1024, host="inference")
        try:
            for version, lr, action in DELTA_STEPS:
                if lr is not None:
                    state = train_step(params, optimizer, inputs, lr)
                if action == "restart":  # a new trainer process would hold no base either
                    ch.close()
                    ch = open_channel(role, address, bucket_bytes=256 * 1024, host="inference")
                save_file(state, os.path.join(out, f"v{version}.safetensors"))
                try:
                    row = stats_row(ch.push(state, version))
                except SyncError as exc:
                    row = {"version": version, "error": str(exc)}
                row.update(delta=row.get("delta"), base_bytes=ch._base.nbytes, state_bytes=nbytes(state))
                result.setdefault("pushes", []).append(row)
        finally:
            ch.close()
        return
    import distload.live.delta as delta_module
    from distload.tp.slices import take_shard
    from distload.tp.spec import load_spec

    model_config = {k: LLAMA_CONFIG[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    spec = load_spec("decoder", model_config)
    with open_channel(role, address, tensor_parallel_size=2, sharding="decoder", model_config=model_config,
                      host="inference") as ch:  # the store outlives a restarted trainer
        tp_rank = ch.rank % 2

        def expected(version):
            whole = load_file(os.path.join(out, f"v{version}.safetensors"))
            return {n: take_shard(t, spec.action(n, tuple(t.shape)), tp_rank, 2, n).contiguous()
                    for n, t in whole.items()}

        target = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in llama_slice_shapes(2).items()}
        real_receive = delta_module.receive_bucket
        for version, _, action in DELTA_STEPS:
            calls = []
            # Drift and flips are written through a numpy view of the memory (as a kernel writing
            # through the pointer would): torch's count of writes does not see them, the patch sums
            # and the audit must. A torch op's rewrite is seen before any byte moves: a full update.
            if action == f"drift-{ch.rank}":  # an engine rewrote a weight in place: same storage
                drifted = target["model.layers.0.mlp.up_proj.weight"]
                untracked(drifted)[:] = untracked(drifted.float().add(0.5).to(torch.bfloat16))
            if action == f"rewrite-{ch.rank}":  # the same through a torch op: its write count moves
                target["model.layers.0.mlp.up_proj.weight"].add_(0.5)
            if action == f"move-{ch.rank}":  # an engine repacked a weight into new memory
                target["model.layers.1.self_attn.q_proj.weight"] = target["model.layers.1.self_attn.q_proj.weight"].clone()
            if action == f"flip-{ch.rank}":  # a bug flipped bits the next update does not touch
                for t in target.values():
                    untracked(t)[::97] ^= 1
            if action == f"fail-{ch.rank}":
                def failing(*a, **k):
                    calls.append(1)
                    if len(calls) == 3:
                        raise RuntimeError("injected: this receiver fails in its third bucket")
                    return real_receive(*a, **k)
                delta_module.receive_bucket = failing
            before = {n: t.clone() for n, t in target.items()}
            try:
                row = stats_row(ch.receive(target))
            except SyncError as exc:
                row = {"version": version, "error": str(exc)}
            finally:
                delta_module.receive_bucket = real_receive
            held = ch.version
            row.update(channel_version=held, consistent=ch.consistent, delta=row.get("delta"),
                       unchanged=exact(target, before), own_bytes=nbytes(target), calls=len(calls),
                       exact=held is not None and exact(target, expected(held)))
            result.setdefault("receives", []).append(row)


# -- cuts: receivers that say what they keep (a vLLM worker's weight map) ------------------------

CUT_SHAPES = {"fused": ((96, 64), torch.bfloat16), "rows": ((64, 128), torch.float32), "norm": ((32,), torch.bfloat16),
              "skipped": ((40, 40), torch.bfloat16), "big": ((1024, 1024), torch.float32),
              "wide": ((256, 2048), torch.bfloat16)}
# Per inference rank: {name: (dim, ranges)}; a name left out is kept whole, no ranges: nothing of it.
CUTS = {0: {"fused": (0, [(0, 16), (48, 64)]), "rows": (1, [(0, 64)]), "big": (0, [(0, 512)]),
            "wide": (1, [(0, 1024)])},
        1: {"fused": (0, [(16, 48), (64, 96)]), "rows": (1, [(64, 128)]), "skipped": (0, []),
            "big": (0, [(512, 1024)]), "wide": (1, [(1024, 2048)])}}


def stepped(version: int) -> dict[str, torch.Tensor]:
    """Versions that change like training steps: version v+1 is v with about 1% of the elements new
    (3% would go whole on one host: docs/delta-sync.md)."""
    state = state_of(CUT_SHAPES, 1)
    for v in range(2, version + 1):
        for name, t in state.items():
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}@step{v}".encode()))
            flat = t.view(-1)
            where = torch.rand(flat.numel(), generator=gen) < 0.01
            flat[where] = (torch.randn(int(where.sum()), generator=gen) * 8).to(t.dtype)
    return state


def cut_of(state, cuts) -> dict[str, torch.Tensor]:
    return {n: t if n not in cuts else torch.cat([t.narrow(cuts[n][0], a, b - a) for a, b in cuts[n][1]] or
                                                 [t.narrow(cuts[n][0], 0, 0)], cuts[n][0])
            for n, t in state.items()}


def cuts(role, address, result, args):
    """The trainer pushes 3 stepped versions; each inference rank keeps the cuts CUTS gives it
    (runs of rows, columns, nothing, whole), said by ``keeps=``, received into its own tensors."""
    if role == "trainer":
        with open_channel(role, address, bucket_bytes=256 * 1024) as ch:
            for version in (1, 2, 3):
                state = stepped(version)
                result.setdefault("pushes", []).append({**stats_row(ch.push(state, version)),
                                                        "state_bytes": nbytes(state)})
        return
    mine = CUTS[int(os.environ["RANK"])]
    seen = []

    def keeps(entries):
        seen.append(sorted(e.name for e in entries))
        return mine

    with open_channel(role, address, keeps=keeps) as ch:
        target = {n: torch.zeros_like(t) for n, t in cut_of(stepped(1), mine).items()}
        result["target_bytes"] = nbytes(target)
        for version in (1, 2, 3):
            stats = ch.receive(target)
            result.setdefault("receives", []).append(
                {**stats_row(stats), "exact": exact(target, cut_of(stepped(version), mine))})
    result["seen"] = seen


# -- choice: a delta update that sends some tensors whole -----------------------------------------

CHOICE_SHAPES = {"dense": (512, 512), "sparse": (512, 512), "norm": (512,)}  # bf16; 2 compare blocks each
# (version, what changes from the version before, in each tensor: "all" (every element), a
# stride (one element in that many), or nothing)
CHOICE_STEPS = [(1, {}), (2, {"dense": "all", "sparse": 1000}), (3, {"dense": "all", "sparse": "all", "norm": "all"}),
                (4, {"dense": "all", "sparse": 997}), (4, {}), (5, {"dense": "all", "sparse": 991}),
                (6, {"dense": "all", "sparse": 983})]


def choice_state(version: int) -> dict[str, torch.Tensor]:
    """CHOICE_STEPS' version ``version``: each change flips the lowest bit of the elements it names."""
    gen = torch.Generator().manual_seed(11)
    state = {n: (torch.randn(shape, generator=gen) * 4).to(torch.bfloat16) for n, shape in CHOICE_SHAPES.items()}
    for v, changes in CHOICE_STEPS[1:]:
        if v > version:
            break
        for name, how in changes.items():
            bits = state[name].view(torch.int16).reshape(-1)
            bits[::1 if how == "all" else how] ^= 1
    return state


def choice(role, address, result, args):
    """The default (delta) channel, on ``args[0]``'s transport: v2 changes every element of one
    tensor and a few of another (one whole, one a patch, in one bucket); v3 every element of all
    of them; v4's whole piece is corrupted as it lands on the receiver (the update fails, rolled
    back), then pushed again (every byte); v5 and v6 mixed again: dense gave up again at v4, rests
    at v5 and is refreshed at v6, sparse gave up at v3, was refreshed at v4 and is a patch again."""
    import distload.live.delta as delta_module

    transport = args[0]
    if role == "trainer":
        with open_channel(role, address, transport=transport) as ch:
            for version, _ in CHOICE_STEPS:
                state = choice_state(version)
                try:
                    stats = ch.push(state, version)
                    row = {**stats_row(stats), "sent_whole": list(stats.sent_whole), "whole_bytes": stats.whole_bytes}
                except SyncError as exc:
                    row = {"version": version, "error": str(exc)}
                ch._base.settle()
                row["scratch_bytes"] = sum(a.nbytes for lanes in ch._base.scratch.arrays.values() for a in lanes)
                row["state_bytes"] = nbytes(state)
                result.setdefault("pushes", []).append(row)
        return
    real_receive = delta_module.receive_bucket

    def corrupting(data, counts, layout, entries, *rest, **kw):
        """The first piece sent whole: one byte of it flipped as it lands (a copy: a same-host
        trainer's segment is its memory, not this rank's)."""
        whole = [k for k, count in enumerate(counts) if count == delta_module.RAW]
        if whole and data is not None:
            at, _ = delta_module.offsets(delta_module.data_sizes(layout, entries, counts), delta_module.ALIGN)
            data = data.clone()
            data[at[whole[0]] + 5] ^= 1
        return real_receive(data, counts, layout, entries, *rest, **kw)

    with open_channel(role, address, transport=transport) as ch:
        target = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in CHOICE_SHAPES.items()}
        for number, (version, _) in enumerate(CHOICE_STEPS):
            before = {n: t.clone() for n, t in target.items()}
            delta_module.receive_bucket = corrupting if number == 3 else real_receive
            try:
                stats = ch.receive(target)
                row = {**stats_row(stats), "sent_whole": list(stats.sent_whole), "whole_bytes": stats.whole_bytes}
            except SyncError as exc:
                row = {"version": version, "error": str(exc)}
            finally:
                delta_module.receive_bucket = real_receive
            row.update(channel_version=ch.version, consistent=ch.consistent, unchanged=exact(target, before),
                       exact=ch.version is not None and exact(target, choice_state(ch.version)))
            result.setdefault("receives", []).append(row)


MARGIN_SHAPES = {"a.weight": (256, 512), "b.weight": (512, 256)}
MARGIN_VERSIONS = range(1, 7)


def margin_state(version: int) -> dict[str, torch.Tensor]:
    """Version ``version``: each version after the first flips the lowest bit of one element in
    25 (4%, the fraction a real AdamW step changes in bf16) of every tensor."""
    gen = torch.Generator().manual_seed(5)
    state = {n: (torch.randn(shape, generator=gen) * 4).to(torch.bfloat16) for n, shape in MARGIN_SHAPES.items()}
    for v in range(2, version + 1):
        for t in state.values():
            t.view(torch.int16).reshape(-1)[v::25] ^= 1
    return state


def margin(role, address, result, args):
    """The same versions, 4% of the elements changed each, through two default (delta) channels:
    this one handed off through shared memory (one host), and one at ``args[0]`` on the socket."""
    with open_channel(role, address) as ch, open_channel(role, args[0], transport="socket") as sock:
        target = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in MARGIN_SHAPES.items()}
        other = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in MARGIN_SHAPES.items()}
        for version in MARGIN_VERSIONS:
            state = margin_state(version)
            for kind, channel, into in (("auto", ch, target), ("socket", sock, other)):
                stats = channel.push(state, version) if role == "trainer" else channel.receive(into)
                row = {**stats_row(stats), "sent_whole": list(stats.sent_whole), "state_bytes": nbytes(state)}
                if role != "trainer":
                    row["exact"] = exact(into, state)
                result.setdefault(kind, []).append(row)


SCENARIOS = {"choice": choice, "margin": margin, "cuts": cuts, "delta": delta, "full": full, "two-trainers": two_trainers, "sliced": sliced, "misfit": misfit, "verify": verify,
             "sleep": sleep}


def main() -> int:
    scenario, role, address, out, *args = sys.argv[1:]
    rank = int(os.environ["RANK"])
    result = {"role": role, "rank": rank, "world_size": int(os.environ["WORLD_SIZE"]),
              "job": os.environ["MASTER_PORT"], "pid": os.getpid(), "out": out}
    code = 0
    try:
        SCENARIOS[scenario](role, address, result, args)
    except BaseException:  # noqa: BLE001 - reported to the test, and the job fails
        result["crash"] = traceback.format_exc()
        traceback.print_exc()
        code = 1
    with open(os.path.join(out, f"{role}{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
