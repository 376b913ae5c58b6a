"""The blocking sync's fast paths (issue 16) compute exactly what the slower code they replaced
did: the float64 accumulation without a float64 copy, the finiteness check by a float64 sum,
decoding fp32 straight into place, chunks written to wire bytes by hand, the outer step's
cheaper snapshot of the optimizer state (all or nothing still), the lossless downlink that
is not decoded again, and the streamed, hashed checkpoint write."""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import math
import random
import time
from pathlib import Path

import pytest
import torch

from diloco import checkpoint as ck
from diloco.codec import CodecError, get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.commit import UpdateEncoder
from diloco.outer import OuterConfig, OuterOptimizer, OuterStepRefused, WeightedMean, check_update
from diloco.transport import serde
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.types import Chunk, JoinRequest, PushHeader
from diloco.wire import ChunkAssembler, all_finite, encode_chunks, fingerprint

pytestmark = pytest.mark.timeout(60)


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the float64 accumulation ------------------------------------------------------------


@pytest.mark.parametrize("aggregate", ["mean", "nonzero"])
def test_the_weighted_mean_is_bit_for_bit_the_one_with_a_float64_copy(aggregate: str) -> None:
    g = _g()
    shapes = {"a": torch.Size([1001, 7]), "b": torch.Size([13])}
    acc = WeightedMean(shapes, aggregate)
    ref_sum = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    ref_w = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    total = 0.0
    for weight in (4096.0, 123457.0, 3.0, 2.0**29 - 1):
        delta = {n: torch.randn(s, generator=g) * 10.0 ** torch.randint(-12, 12, s, generator=g).float() for n, s in shapes.items()}
        delta["a"][0, :3] = 0.0
        acc.add(delta, weight)
        for n in shapes:
            ref_sum[n].add_(delta[n].double(), alpha=weight)
            ref_w[n].add_(delta[n] != 0, alpha=weight)
        total += weight
    mean = acc.mean()
    for n in shapes:
        divisor = total if aggregate == "mean" else torch.where(ref_w[n] > 0, ref_w[n], 1.0)
        assert torch.equal(mean[n], (ref_sum[n] / divisor).float())


def test_a_mean_of_nothing_is_refused_and_buffers_wait_for_the_first_push() -> None:
    acc = WeightedMean({"w": torch.Size([4])})
    with pytest.raises(ValueError, match="no contributions"):
        acc.mean()
    acc.add({"w": torch.ones(4)}, 2.0)
    assert torch.equal(acc.mean()["w"], torch.ones(4))


# ---- finiteness ---------------------------------------------------------------------------


def test_all_finite_agrees_with_isfinite() -> None:
    big = torch.full((1 << 16,), 3.4e38)
    cases = [torch.zeros(0), torch.randn(1000), big, -big, torch.tensor([float("inf")]), torch.tensor([1.0, float("nan")]),
             torch.tensor([float("inf"), float("-inf")]), torch.tensor([-0.0, 1e-45]), torch.randn(100).half(), torch.randn(100).bfloat16(),
             torch.tensor([1.0, float("inf")], dtype=torch.float64)]  # fmt: skip
    for i in range(50):
        t = torch.randn(997, generator=_g(i))
        t[i * 17 % 997] = random.Random(i).choice([float("inf"), float("-inf"), float("nan"), 1.0])
        cases.append(t)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t


# ---- fp32 decoded into place --------------------------------------------------------------


def test_fp32_decode_into_equals_decode_and_checks_the_length() -> None:
    codec = get_codec("fp32")
    x = torch.randn(1000, generator=_g())
    payload = codec.encode(x)
    out = torch.empty(2000)
    codec.decode_into(payload, 1000, out[500:1500])
    assert torch.equal(out[500:1500], codec.decode(payload, 1000))
    with pytest.raises(CodecError, match="expected 3996"):
        codec.decode_into(payload, 999, out[:999])
    codec.decode_into(b"", 0, out[:0])


def test_the_assembler_refuses_a_non_finite_fp32_chunk_decoded_into_place() -> None:
    x = torch.randn(10, generator=_g())
    x[3] = float("nan")
    chunks = list(encode_chunks({"w": x}, codec=get_codec("fp32")))
    assembler = ChunkAssembler(fingerprint({"w": x}))
    with pytest.raises(CodecError, match="non-finite values in 'w': 1 of 10"):
        assembler.add(chunks[0])


# ---- chunks to wire bytes -----------------------------------------------------------------


def test_chunks_written_by_hand_are_protobufs_bytes() -> None:
    rng = random.Random(0)
    for _ in range(500):
        c = Chunk(
            name=rng.choice(["", "w", "layers.0.attn.q.weight", "é" * rng.randint(0, 80)]), shape=tuple(rng.randint(-3, 1 << 40) for _ in range(rng.randint(0, 4))),
            dtype=rng.choice(["", "float32"]), offset=rng.choice([0, 1, 127, 128, 1 << 33, -5]), numel=rng.choice([0, 5, 300, 262144]), codec=rng.choice(["", "fp32", "int8+zstd"]),
            payload=rng.randbytes(rng.choice([0, 1, 127, 128, 300, 20000])), box_start=tuple(rng.randint(0, 500) for _ in range(rng.randint(0, 3))),
            box_shape=tuple(rng.randint(0, 500) for _ in range(rng.randint(0, 3))),
        )  # fmt: skip
        assert serde.chunk_to_wire(c) == serde.chunk_to_proto(c).SerializeToString()
        assert serde.global_chunk_to_wire(c) == pb.GlobalMessage(chunk=serde.chunk_to_proto(c)).SerializeToString()
        assert serde.chunk_from_proto(pb.TensorChunk.FromString(serde.chunk_to_wire(c))) == c


# ---- the outer step -----------------------------------------------------------------------


class _Reference:
    """The outer step as it was before issue 16: a deepcopy of the state dict, norms measured
    as they come, θ restored and the update added."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: OuterConfig) -> None:
        self.names = sorted(params)
        self.params = {n: params[n].clone() for n in self.names}
        self.opt = cfg.build([self.params[n] for n in self.names])

    def step(self, mean: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = [n for n in self.names if n in mean]
        before = {n: self.params[n].clone() for n in names}
        saved = copy.deepcopy(self.opt.state_dict())
        for n in names:
            self.params[n].grad = mean[n].clone()
        self.opt.step()
        proposed = {}
        for n in names:
            proposed[n] = self.params[n] - before[n]
            self.params[n].grad = None
            self.params[n].copy_(before[n])
        size = math.sqrt(sum(float((t.double() ** 2).sum()) for t in proposed.values()))
        if not math.isfinite(size) or size > 100 * max(math.sqrt(sum(float((t.double() ** 2).sum()) for t in before.values())), 1.0):
            self.opt.load_state_dict(saved)
            raise OuterStepRefused("refused")
        for n in names:
            self.params[n].add_(proposed[n])
        return proposed


def _opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]


@pytest.mark.parametrize(
    "cfg",
    [
        OuterConfig(),
        OuterConfig(name="Adam", lr=0.01, kwargs={"betas": (0.9, 0.99)}),
        OuterConfig(name="DelayedNesterov", period=2),
        OuterConfig(momentum=0.0, nesterov=False),
    ],
    ids=["nesterov", "adam", "delayed", "sgd"],
)
def test_the_outer_step_is_bit_for_bit_the_old_one_fragments_and_refusals_included(cfg: OuterConfig) -> None:
    g = _g()
    theta = {"a": torch.randn(40, 8, generator=g), "b": torch.randn(8, generator=g), "c": torch.randn(3, 3, generator=g)}
    ours, ref = OuterOptimizer(theta, cfg), _Reference(theta, cfg)
    fragments = [("a", "b", "c"), ("a",), ("b", "c"), ("a", "b", "c"), ("c",), ("a", "b", "c")]
    for i, names in enumerate(fragments * 2):
        mean = {n: torch.randn(theta[n].shape, generator=g) * 0.01 for n in names}
        if i in (4, 9):  # refused: θ and the optimizer state stay, on both
            mean[names[0]][0] = float("inf")
            for o in (ours, ref):
                with pytest.raises(OuterStepRefused):
                    o.step(mean)
        else:
            u = ours.step(mean)
            v = ref.step(mean)
            assert all(torch.equal(u[n], v[n]) for n in names)
            assert ours.update_norm == math.sqrt(sum(float((t.double() ** 2).sum()) for t in v.values()))
        assert all(torch.equal(ours.params[n], ref.params[n]) for n in theta)
        a, b = _opt_tensors(ours._opt), _opt_tensors(ref.opt)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert ours._opt.state_dict()["param_groups"] == ref.opt.state_dict()["param_groups"]


def test_a_refused_first_step_leaves_no_optimizer_state() -> None:
    outer = OuterOptimizer({"w": torch.ones(3)}, OuterConfig(name="Adam", lr=0.1))

    def broken(_u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("encoder broke")

    with pytest.raises(OuterStepRefused, match="encoder broke"):
        outer.step({"w": torch.ones(3)}, transmit=broken)
    assert not outer._opt.state and torch.equal(outer.params["w"], torch.ones(3))


def test_an_absurd_update_is_still_measured_against_theta() -> None:
    theta = {"w": torch.full((4,), 1000.0)}  # |θ| = 2000: the limit is 200000
    assert check_update("u", {"w": torch.full((4,), 50.0)}, theta) == 100.0  # under 100: |θ| not needed
    assert check_update("u", {"w": torch.full((4,), 5000.0)}, theta) == 10000.0
    with pytest.raises(OuterStepRefused, match="over 100 x max"):
        check_update("u", {"w": torch.full((4,), 200000.0)}, theta)
    with pytest.raises(OuterStepRefused, match="over 100 x max"):
        check_update("u", {"w": torch.full((4,), 60.0)}, {"w": torch.zeros(4)})  # 120 > 100 x max(0, 1)
    with pytest.raises(OuterStepRefused, match="not finite"):
        check_update("u", {"w": torch.tensor([float("nan")])}, theta)


@pytest.mark.parametrize("codec", ["fp32", "fp32+zstd"])
def test_a_lossless_downlink_sends_exactly_the_update_without_decoding_it_again(codec: str) -> None:
    u = {"a": torch.randn(300, 5, generator=_g()), "b": torch.tensor([-0.0, 1e-45, 3.4e38])}
    specs = fingerprint(u)
    sent: list[list[Chunk]] = []
    out = UpdateEncoder.of(get_codec(codec), specs, 1 << 12, True).transmit(u, sent.append)
    assert out is u
    assembler = ChunkAssembler(specs)
    for c in sent[0]:
        assembler.add(c)
    got = assembler.finish()
    assert all(torch.equal(got[n].view(torch.int32), u[n].view(torch.int32)) for n in u)  # bit for bit, -0.0 included


# ---- the checkpoint -----------------------------------------------------------------------


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


def _rich_state() -> dict:
    g = _g()
    big = torch.randn(64, 33, generator=g)
    return {
        "outer": {"params": {f"p{i}": torch.randn(1000 * i + 3, generator=g) for i in range(12)}, "optimizer": {"state": {0: {"momentum_buffer": big * 2, "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.7, "params": [0]}]}},
        "dtypes": [torch.randn(3000, generator=g).to(d) for d in (torch.float16, torch.bfloat16, torch.float64)] + [torch.arange(5000), torch.arange(5000) % 3 == 0, torch.zeros(0, 2048)],
        "view": big.t(), "small": torch.ones(3), "large": torch.randn(700_000, generator=g), "tuple": (1, "a", big[:40]), "od": collections.OrderedDict(b=1, a=torch.zeros(2048)),
        "meta": {"round": 3, "names": ["a", "b"], "pairs": [("s", 1)], 7: None},
    }  # fmt: skip


def test_a_checkpoint_round_trips_every_kind_of_state(tmp_path: Path) -> None:
    state = _rich_state()
    path = ck.save_checkpoint(tmp_path, 3, state)
    data = path.read_bytes()
    magic, version, length, digest = ck._HEADER.unpack_from(data)
    payload = data[ck._HEADER.size :]
    assert (magic, version, length) == (ck.MAGIC, 2, len(payload))
    segments = [hashlib.sha256(payload[i : i + (1 << 20)]).digest() for i in range(0, len(payload), 1 << 20)]
    assert len(segments) > 1 and hashlib.sha256(b"".join(segments)).digest() == digest
    loaded = ck.read_checkpoint(path)
    assert _same(state, loaded)
    assert loaded["view"].is_contiguous()  # saved as its values
    w = loaded["outer"]["params"]["p3"]
    w += 1  # each loaded tensor owns its memory
    assert torch.equal(ck.read_checkpoint(path)["outer"]["params"]["p3"], state["outer"]["params"]["p3"])


def test_a_format_1_checkpoint_is_still_read(tmp_path: Path) -> None:
    import io

    state = _rich_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    path = tmp_path / "ckpt-00000001.pt"
    path.write_bytes(ck._HEADER.pack(ck.MAGIC, 1, len(payload), hashlib.sha256(payload).digest()) + payload)
    assert _same(state, ck.read_checkpoint(path))


def test_a_tampered_tensor_reference_is_refused_even_with_a_good_checksum(tmp_path: Path) -> None:
    import io

    path = ck.save_checkpoint(tmp_path, 1, {"w": torch.zeros(4096)})
    payload = path.read_bytes()[ck._HEADER.size :]
    for ref in (
        [0, 1 << 40, "float32", [1 << 38]],
        [0, 16384, "float32", [4097]],
        [0, 16384, "complex64", [2048]],
        [-64, 16384, "float32", [4096]],
        "x",
        [0, 16384, "float32", [-4096]],
    ):
        buf = io.BytesIO()
        torch.save({"w": {ck._RAW_KEY: ref}}, buf)
        skeleton = buf.getvalue()
        forged = payload[:16384] + skeleton + ck._LENGTH.pack(len(skeleton))
        path.write_bytes(ck._HEADER.pack(ck.MAGIC, 2, len(forged), ck._tree_digest(memoryview(forged))) + forged)
        with pytest.raises(ck.CheckpointError, match="payload does not load"):
            ck.read_checkpoint(path)
    with pytest.raises(ValueError, match="may not hold the key"):
        ck.save_checkpoint(tmp_path, 2, {"x": {ck._RAW_KEY: 1}})


def test_pruning_keeps_one_spare_to_write_over_and_deletes_the_rest(tmp_path: Path) -> None:
    (tmp_path / ".ckpt-00000000.pt.old").write_bytes(b"left by a crash")
    sizes = [100000, 10, 50000, 70000, 5, 200000]  # the spare written over is longer, or shorter
    for r, n in enumerate(sizes, start=1):
        ck.save_checkpoint(tmp_path, r, {"r": r, "w": torch.full((n,), float(r))}, keep=2)
        assert [p.name for p in ck.list_checkpoints(tmp_path)] == [f"ckpt-{k:08d}.pt" for k in range(max(1, r - 1), r + 1)]
        loaded = ck.load_latest(tmp_path)
        assert loaded is not None and loaded.round == r and torch.equal(loaded.state["w"], torch.full((n,), float(r)))
    ck.save_checkpoint(tmp_path, 7, {"r": 7}, keep=1)  # two pruned at once: one spare, one deleted
    deadline = time.monotonic() + 10
    while list(tmp_path.glob(".*.old")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt-spare", "ckpt-00000007.pt"]


def test_a_failing_write_leaves_no_file_and_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck.save_checkpoint(tmp_path, 1, {"r": 1})

    def full(*_args: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint(tmp_path, 2, {"r": torch.zeros(100000)})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001.pt"]
    ck.save_checkpoint(tmp_path, 2, {"r": 2})
    ck.save_checkpoint(tmp_path, 3, {"r": 3})  # a spare now: its write fails the same way
    monkeypatch.setattr(ck.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint(tmp_path, 4, {"r": torch.zeros(100000)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002.pt", "ckpt-00000003.pt"]
    assert ck.load_latest(tmp_path).round == 3  # type: ignore[union-attr]


# ---- what the coordinator records of its commits ------------------------------------------


def test_the_coordinator_times_each_commit_and_names_the_push_that_closed_it(tmp_path: Path) -> None:
    theta = {"w": torch.ones(3, 4), "b": torch.zeros(4)}
    coord = Coordinator(theta, OuterConfig(), CoordinatorConfig(total_rounds=2, min_sites=2, checkpoint_dir=str(tmp_path)))
    for s in ("a", "b"):
        coord.join(JoinRequest(s, tuple(fingerprint(theta).values())))
    for s in ("a", "b"):
        delta = {n: torch.full_like(p, 0.01) for n, p in theta.items()}
        coord.push(PushHeader(site_id=s, round=0, tokens=10, train_loss=1.0, inner_steps=1), encode_chunks(delta, codec=get_codec("fp32")))
    (t,) = coord.commit_timings()
    assert t["round"] == 0 and t["closer"] == "b"
    for k in ("receive_s", "lock_s", "commit_s", "mean_s", "step_s", "encode_s", "record_s", "checkpoint_s", "publish_s"):
        assert t[k] >= 0.0, k
    assert t["commit_s"] >= t["mean_s"] + t["step_s"]


# ---- bundles --------------------------------------------------------------------------------


def _many() -> dict[str, torch.Tensor]:
    g = _g(3)
    return {f"layer{i}.{k}": torch.randn(*shape, generator=g) for i in range(6) for k, shape in (("w", (16, 8)), ("b", (8,)), ("norm", (3,)))} | {
        "emb": torch.randn(300, 300, generator=g)
    }


@pytest.mark.parametrize("codec", ["fp32", "int8", "topk2bit+zstd"])
def test_bundled_chunks_assemble_to_exactly_what_the_plain_ones_do(codec: str) -> None:
    from diloco.wire import bundle_chunks, is_bundle, unbundled

    tensors = _many()
    specs = fingerprint(tensors)
    plain = list(encode_chunks(tensors, codec=get_codec(codec), chunk_bytes=1 << 16))
    bundled = bundle_chunks(plain, 1 << 16)
    assert len(bundled) < len(plain) and any(is_bundle(c) for c in bundled) and all(len(c.payload) <= 1 << 16 for c in bundled)
    assert [(c.name, c.offset, c.numel, c.codec, bytes(c.payload)) for c in unbundled(bundled)] == [
        (c.name, c.offset, c.numel, c.codec, c.payload) for c in plain
    ]
    a, b = ChunkAssembler(specs), ChunkAssembler(specs)
    for c in plain:
        a.add(c)
    for c in bundled:
        b.add(c)
    x, y = a.finish(), b.finish()
    assert a.payload_bytes == b.payload_bytes and all(torch.equal(x[n], y[n]) for n in x)
    assert bundle_chunks(plain[:7], 1 << 16) == plain[:7]  # too few to bundle: as they were


def test_a_broken_bundle_is_refused_naming_what_is_wrong() -> None:
    from diloco.wire import bundle_chunks, is_bundle

    tensors = _many()
    specs = fingerprint(tensors)
    bundle = next(c for c in bundle_chunks(list(encode_chunks(tensors, codec=get_codec("fp32"))), 1 << 20) if is_bundle(c))
    p = bundle.payload
    nested = dataclasses.replace(bundle, numel=1, payload=b"DLBN" + (1).to_bytes(4, "little") + _frame(bundle))
    cases = [
        (dataclasses.replace(bundle, payload=p[: len(p) // 2]), "runs past the end"),
        (dataclasses.replace(bundle, payload=p + b"x"), "bytes after its"),
        (dataclasses.replace(bundle, numel=bundle.numel + 1), "the chunk declares"),
        (dataclasses.replace(bundle, payload=b"XXXX" + p[4:]), "not b'DLBN'"),
        (dataclasses.replace(bundle, name="w"), "no name, dtype"),
        (dataclasses.replace(bundle, payload=p + bytes(1 << 20)), "over the limit"),
        (nested, "a bundle inside a bundle"),
    ]
    for broken, message in cases:
        with pytest.raises(CodecError, match=message):
            assembler = ChunkAssembler(specs)
            assembler.add(broken)
    rng = random.Random(0)
    for _ in range(300):  # random damage: refused as a CodecError, never anything else
        b = bytearray(p)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            ChunkAssembler(specs).add(dataclasses.replace(bundle, payload=bytes(b[: rng.randint(0, len(b))])))
        except CodecError:
            pass


def _frame(c: Chunk) -> bytes:
    from diloco.wire import bundles

    return b"".join(bundles._framed(c))


def test_the_coordinator_takes_bundled_pushes_and_serves_bundled_pulls(tmp_path: Path) -> None:
    from diloco.wire import bundle_chunks, is_bundle

    theta = _many()
    specs = fingerprint(theta)
    coords = [
        Coordinator(theta, OuterConfig(), CoordinatorConfig(total_rounds=3, min_sites=2, checkpoint_dir=str(tmp_path / str(i)), bundle_downlink=bool(i)))
        for i in range(2)
    ]
    site = {n: t.clone() for n, t in theta.items()}
    for coord in coords:
        for s in ("a", "b"):
            coord.join(JoinRequest(s, tuple(specs.values())))
    for r in range(3):
        for i, s in enumerate(("a", "b")):
            g = _g(10 * r + i)
            delta = {n: torch.randn(t.shape, generator=g) * 0.01 for n, t in theta.items()}
            plain = list(encode_chunks(delta, codec=get_codec("fp32")))
            for coord, chunks in zip(coords, (plain, bundle_chunks(plain, 1 << 20))):
                assert coord.push(PushHeader(site_id=s, round=r, tokens=10, train_loss=1.0, inner_steps=1), iter(chunks)).accepted
        served = [coord.pull_update("a", r) for coord in coords]
        assert not any(is_bundle(c) for c in served[0]) and any(is_bundle(c) for c in served[1]) and len(served[1]) < len(served[0])
        assembler = ChunkAssembler(specs)
        for c in served[1]:
            assembler.add(c)
        for n, u in assembler.finish().items():
            site[n].add_(u)
        from diloco.outer import params_sha256

        assert coords[0].global_sha256() == coords[1].global_sha256() == params_sha256(site)
        assert coords[0].bytes_down(r) == coords[1].bytes_down(r)  # the tensors' payloads, framing excluded
    rows = {"emb": __import__("diloco.boxes", fromlist=["Box"]).Box((10, 0), (5, 300))}
    sliced = coords[1].pull_update("b", 2, want=rows)
    assert sliced and not any(is_bundle(c) for c in sliced) and {c.name for c in sliced} == {"emb"}
    status, chunks = coords[1].pull_global("a")
    assert any(is_bundle(c) for c in chunks)


def test_a_pushed_chunk_is_read_as_protobuf_reads_it_whatever_its_encoding() -> None:
    from google.protobuf.message import DecodeError

    rng = random.Random(1)

    def parsed(data: bytes) -> object:
        try:
            got = serde.push_message_from_wire(data)
        except DecodeError:
            return "DecodeError"
        return got if isinstance(got, Chunk) else (serde.chunk_from_proto(got.chunk) if got.WhichOneof("kind") == "chunk" else got.WhichOneof("kind"))

    def reference(data: bytes) -> object:
        try:
            m = pb.PushMessage.FromString(data)
        except DecodeError:
            return "DecodeError"
        return serde.chunk_from_proto(m.chunk) if m.WhichOneof("kind") == "chunk" else m.WhichOneof("kind")

    c = Chunk(name="layer.w", shape=(4, 3), dtype="float32", offset=2, numel=10, codec="fp32", payload=bytes(range(40)), box_start=(1, 0), box_shape=(2, 3))
    canonical = pb.PushMessage(chunk=serde.chunk_to_proto(c)).SerializeToString()
    body = canonical[2:]
    odd = [
        canonical,
        b"\x12" + bytes([len(body) + 4]) + body + b"\x20\x05" + b"\x28\x07",  # offset and numel again: the last wins
        b"\x12" + bytes([len(body) + 3]) + b"\x1a\x01x" + body,  # dtype before name
        b"\x12" + bytes([len(body) + 2]) + body + b"\x60\x01",  # an unknown field
        b"\x12" + bytes([len(body) + 4]) + body + b"\x48\x05\x48\x06",  # box_start unpacked
        b"\x12\x03\x0a\x01\xff",  # a name that is not UTF-8
        b"\x0a\x02\x08\x01",  # a header
        b"",
        b"\x12",
        b"\x12\x05\x0a",
    ]
    odd += [bytes(rng.randrange(256) for _ in range(rng.randint(0, 60))) for _ in range(400)]
    odd += [canonical[: rng.randint(0, len(canonical))] for _ in range(100)]
    for data in odd:
        assert parsed(data) == reference(data), data
    assert isinstance(serde.push_message_from_wire(canonical), Chunk)
