"""Your own model: θ₀ from the first site (init=site) or a file (init=file), models the
project does not know (model=custom, model=hf) through diloco-sim with evaluation where it
fits, and every bad input named before any training step, the coordinator serving on."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import coordinator, join, push, run_ok, served_coordinator

from diloco.app.config import ConfigError, InitConfig, RunConfig
from diloco.app.coordinator import initial_params
from diloco.boxes import Box
from diloco.codec import get_codec
from diloco.coordinator import Coordinator, CoordinatorConfig, CoordinatorError
from diloco.coordinator.init_file import InitFileError, load_init_file
from diloco.coordinator.round_policy import QuorumConfig
from diloco.model import build_model, model_config
from diloco.outer import OuterConfig, params_sha256
from diloco.sim.sections import check_before_start
from diloco.sync import SyncConfig
from diloco.transport import CoordinatorClient, RemoteError
from diloco.types import JoinRequest, PushHeader
from diloco.wire import encode_chunks
from diloco.wire.fingerprint import fingerprint

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

TINY = model_config("tiny", context=32, d_model=32, n_layers=1, n_heads=2, mlp_hidden=64)


def _popen(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


# ---- a standalone coordinator, θ₀ from the first of two plain user loops ------------------


@pytest.mark.timeout(180)
def test_init_site_standalone_coordinator_with_two_user_loops(tmp_path: Path) -> None:
    port_file = tmp_path / "port.json"
    procs: list[subprocess.Popen] = []
    logs = ["coord.log", "a.log", "b.log"]
    try:
        coord_args = ["init=site", "sites=2", "rounds=3", "sync.every=5", "coordinator.port=0", f"coordinator.port_file={port_file}"]
        procs.append(_popen([str(BIN / "diloco-coordinator"), *coord_args, f"hydra.run.dir={tmp_path / 'coord'}"], tmp_path / "coord.log"))
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "coord.log").read_text()
            time.sleep(0.1)
        address = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
        for site, seed in (("a", 1), ("b", 2)):
            args = [
                "--coordinator",
                address,
                "--site-id",
                site,
                "--seed",
                str(seed),
                "--steps",
                "15",
                "--sync-every",
                "5",
                "--out",
                str(tmp_path / f"{site}.json"),
            ]
            procs.append(_popen([sys.executable, str(ROOT / "tests" / "user_loop_site.py"), *args], tmp_path / f"{site}.log"))
        for p in procs:
            assert p.wait(timeout=150) == 0, "\n".join((tmp_path / n).read_text() for n in logs)
    finally:
        _stop(procs)
    final = json.loads((tmp_path / "coord" / "global.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "coord" / "metrics.jsonl").read_text().splitlines()]
    assert final["rounds_committed"] == 3 and [m["round"] for m in metrics] == [0, 1, 2]
    assert final["params"] == 16 * 64 + 64 + 64 + 1  # the user's MLP, not the built-in transformer
    sites = {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in ("a", "b")}
    # Exactly one site sent θ₀, and both started from it (they built their models from different seeds).
    assert sorted(r["uploaded_init"] for r in sites.values()) == [False, True]
    assert sites["a"]["start_sha256"] == sites["b"]["start_sha256"]
    assert final["init_from"] in ("site 'a'", "site 'b'")
    for r in sites.values():  # bit-identical to the coordinator after every round
        assert r["round_sha256"] == {str(m["round"]): m["global_sha256"] for m in metrics}
        assert r["global_sha256"] == final["global_sha256"]
        assert sum(r["losses"][-5:]) < sum(r["losses"][:5])  # the loss falls
    assert all(m["participants"] == ["a", "b"] and m["tokens"] == 2 * 5 * 32 for m in metrics)
    assert final["eval_by"] == "sites" and all(m["eval_loss"] is None for m in metrics)  # plain loops report no evaluation


# ---- θ₀ in process: the election, refusals, restarts, files ------------------------------


def _coordinator_awaiting_theta0(tmp_path: Path | None = None, **kw: object) -> Coordinator:
    """A coordinator with no θ₀ (init=site): the first site that joins and can upload sends it."""
    cfg = CoordinatorConfig(total_rounds=2, min_sites=1, quorum=QuorumConfig(lease_s=30.0), checkpoint_dir=str(tmp_path / "ckpt") if tmp_path else None, **kw)  # type: ignore[arg-type]
    return coordinator(None, cfg)


def _upload(coord: Coordinator, site: str, params: dict[str, torch.Tensor], codec: str = "fp32") -> None:
    header = PushHeader(site_id=site, round=0, tokens=1, train_loss=math.nan, inner_steps=0)
    coord.upload_init(header, encode_chunks(params, codec=get_codec(codec)))


def _params(seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(TINY, seed).named_parameters()}


@pytest.mark.timeout(60)
def test_a_refused_source_leaves_the_role_to_the_next_site_and_theta_unset() -> None:
    coord = _coordinator_awaiting_theta0()
    good = _params(0)
    specs = list(fingerprint(good).values())
    assert coord.join(JoinRequest("a", tuple(specs), can_upload=True)).upload_init
    bad = dict(good)
    bad["norm.weight"] = torch.full_like(good["norm.weight"], float("nan"))
    with pytest.raises(CoordinatorError, match=r"θ₀ from site 'a' refused: non-finite values in 'norm.weight'"):
        _upload(coord, "a", bad)
    assert not coord.ready and coord.global_sha256() == ""
    assert coord.join(JoinRequest("b", tuple(specs), can_upload=True)).upload_init  # the next site takes the role
    with pytest.raises(CoordinatorError, match="lossless"):
        _upload(coord, "b", good, codec="int8")
    assert coord.join(JoinRequest("b", tuple(specs), can_upload=True)).upload_init
    _upload(coord, "b", good)
    assert coord.ready and coord.global_sha256() == params_sha256(good) and coord.init_from == "site 'b'"
    info = coord.join(JoinRequest("c", tuple(specs), can_upload=True))  # later sites pull θ₀
    assert not info.upload_init
    with pytest.raises(CoordinatorError, match="θ₀ is already set"):
        _upload(coord, "b", _params(1))
    assert coord.global_sha256() == params_sha256(good)
    with pytest.raises(CoordinatorError, match=r"does not match the coordinator's \(θ₀ from site 'b'\)"):
        coord.join(JoinRequest("d", tuple(list(fingerprint(_params(0) | {"extra": torch.zeros(3)}).values()))))


def _upload_part(coord: Coordinator, site: str, params: dict[str, torch.Tensor], rows: dict[str, tuple[int, int]], part: int, codec: str = "fp32") -> None:
    """Part ``part`` of 2 of θ₀: rows [lo, hi) of each named tensor (dimension 0)."""
    header = PushHeader(site_id=site, round=0, tokens=1, train_loss=math.nan, inner_steps=0, part=part, parts=2)
    local = {n: params[n][lo:hi].contiguous() for n, (lo, hi) in rows.items()}
    boxes = {n: (Box((lo, *(0 for _ in params[n].shape[1:])), (hi - lo, *params[n].shape[1:])), tuple(params[n].shape)) for n, (lo, hi) in rows.items()}
    coord.upload_init(header, encode_chunks(local, codec=get_codec(codec), boxes=boxes))


@pytest.mark.timeout(60)
def test_a_multi_rank_source_sends_theta0_in_parts_all_or_nothing() -> None:
    coord = _coordinator_awaiting_theta0()
    good = _params(0)
    specs = tuple(fingerprint(good).values())
    half = {n: (0, t.shape[0] // 2) for n, t in good.items()}
    rest = {n: (t.shape[0] // 2, t.shape[0]) for n, t in good.items()}
    name = next(iter(good))
    # a part overlapping the other's rows: the whole upload refused, θ₀ unset, the role freed
    assert coord.join(JoinRequest("a", specs, can_upload=True)).upload_init
    _upload_part(coord, "a", good, half, 0)
    with pytest.raises(CoordinatorError, match=r"θ₀ from site 'a' \(part 1 of 2\) refused: .*overlaps"):
        _upload_part(coord, "a", good, {**rest, name: (0, good[name].shape[0])}, 1)
    assert not coord.ready
    # parts that leave a gap: refused when the last arrives
    assert coord.join(JoinRequest("b", specs, can_upload=True)).upload_init
    _upload_part(coord, "b", good, half, 0)
    with pytest.raises(CoordinatorError, match="gaps"):
        _upload_part(coord, "b", good, {n: r for n, r in rest.items() if n != name}, 1)
    assert not coord.ready
    # a lossy part, then a part of a site that is not the source
    assert coord.join(JoinRequest("c", specs, can_upload=True)).upload_init
    with pytest.raises(CoordinatorError, match="lossless"):
        _upload_part(coord, "c", good, half, 0, codec="int8")
    assert coord.join(JoinRequest("c", specs, can_upload=True)).upload_init
    with pytest.raises(CoordinatorError, match="not the source"):
        _upload_part(coord, "d", good, half, 0)
    # the two parts, in either order: θ₀ is the whole model
    _upload_part(coord, "c", good, rest, 1)
    assert not coord.ready  # waits for part 0
    _upload_part(coord, "c", good, half, 0)
    assert coord.ready and coord.global_sha256() == params_sha256(good) and coord.init_from == "site 'c'"


@pytest.mark.timeout(60)
def test_two_sites_joining_at_once_elect_one_source_and_the_other_waits() -> None:
    coord = _coordinator_awaiting_theta0()
    specs = list(fingerprint(_params(0)).values())
    infos: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def join(site: str) -> None:
        barrier.wait()
        infos[site] = coord.join(JoinRequest(site, tuple(specs), can_upload=True))

    threads = [threading.Thread(target=join, args=(s,)) for s in ("a", "b")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(infos) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(infos) == 1  # one is the source; the other waits inside Join for θ₀
    source = next(iter(infos))
    assert infos[source].upload_init  # type: ignore[attr-defined]
    _upload(coord, source, _params(0))
    for t in threads:
        t.join(10)
    other = "b" if source == "a" else "a"
    assert not infos[other].upload_init  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_restarted_coordinator_never_asks_for_theta0_again(tmp_path: Path) -> None:
    from diloco.checkpoint import load_latest

    coord = _coordinator_awaiting_theta0(tmp_path)
    good = _params(3)
    specs = list(fingerprint(good).values())
    coord.join(JoinRequest("a", tuple(specs), can_upload=True))
    _upload(coord, "a", good)
    restarted = _coordinator_awaiting_theta0(tmp_path)
    restarted.restore(load_latest(tmp_path / "ckpt").state)  # type: ignore[union-attr]
    assert restarted.ready and restarted.global_sha256() == params_sha256(good) and restarted.init_from == "site 'a'"
    assert not restarted.join(JoinRequest("b", tuple(specs), can_upload=True)).upload_init


@pytest.mark.timeout(60)
def test_init_file_safetensors_and_torch_state_dict(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    params = _params(5)
    save_file(params, str(tmp_path / "theta.safetensors"))
    torch.save({"state_dict": params}, tmp_path / "theta.pt")
    for name in ("theta.safetensors", "theta.pt"):
        cfg = RunConfig(model=TINY, init=InitConfig(source="file", path=str(tmp_path / name)))
        theta0, source = initial_params(cfg)
        assert source == f"init.path={tmp_path / name}"
        coord = Coordinator(theta0, OuterConfig(), CoordinatorConfig(total_rounds=1, init_source=source))
        assert coord.global_sha256() == params_sha256(params)  # θ₀ is the file's tensors
    # A bf16 checkpoint is widened to float32 exactly.
    save_file({n: t.bfloat16() for n, t in params.items()}, str(tmp_path / "bf16.safetensors"))
    widened = load_init_file(tmp_path / "bf16.safetensors")
    assert all(widened[n].dtype == torch.float32 and torch.equal(widened[n], params[n].bfloat16().float()) for n in params)


@pytest.mark.timeout(60)
def test_bad_init_files_are_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with pytest.raises(InitFileError, match=r"init.path=.*missing.safetensors: no such file"):
        load_init_file(tmp_path / "missing.safetensors")
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint at all")
    with pytest.raises(InitFileError, match=r"junk.bin: neither a safetensors file nor a torch.save state dict"):
        load_init_file(tmp_path / "junk.bin")
    save_file({"w": torch.tensor([1.0, float("inf")])}, str(tmp_path / "inf.safetensors"))
    with pytest.raises(InitFileError, match=r"inf.safetensors: 'w' holds 1 non-finite values"):
        load_init_file(tmp_path / "inf.safetensors")
    torch.save({"step": torch.tensor(3)}, tmp_path / "ints.pt")
    with pytest.raises(InitFileError, match=r"ints.pt: 'step' is int64"):
        load_init_file(tmp_path / "ints.pt")
    # A file whose names or shapes differ from the sites' model: refused before any process
    # starts (diloco-sim), and at Join naming the file (a real run); θ stays the file's.
    other = _params(0)
    other["norm.weight"] = torch.ones(7)
    save_file(other, str(tmp_path / "other.safetensors"))
    cfg = RunConfig(model=TINY, init=InitConfig(source="file", path=str(tmp_path / "other.safetensors")))
    with pytest.raises(ConfigError, match=r"init.path=.*other.safetensors: does not fit model=tiny: 'norm.weight'"):
        check_before_start(cfg)
    theta0, source = initial_params(cfg)
    coord = coordinator(theta0, CoordinatorConfig(total_rounds=1, init_source=source))
    with served_coordinator(coord) as address:
        with CoordinatorClient(address, connect_timeout_s=10) as client:
            with pytest.raises(RemoteError, match=r"invalid_argument: .*θ₀ from init.path=.*other.safetensors.*'norm.weight'"):
                join(client, _params(0), "0")
            assert client.join(JoinRequest("1", tuple(fingerprint(other).values()))).total_rounds == 1  # the coordinator serves on
    assert coord.global_sha256() == params_sha256(other)


@pytest.mark.timeout(60)
def test_site_with_another_h_or_codec_is_refused_at_join() -> None:
    params = _params(0)
    settings = RunConfig(rounds=1, sync=SyncConfig(every=50), codec="int8").settings
    coord = Coordinator(params, OuterConfig(), CoordinatorConfig.of_run(settings))
    specs = tuple(fingerprint(params).values())
    with pytest.raises(CoordinatorError, match=r"site 'a' states settings other than this run's: sync.every=10 \(the run's: 50\)"):
        coord.join(JoinRequest("a", specs, stated={"sync.every": 10, "codec.name": "int8"}))
    with pytest.raises(CoordinatorError, match=r'codec.name="fp32" \(the run\'s: "int8"\)'):
        coord.join(JoinRequest("a", specs, stated=settings.stated(("sync.every",)) | {"codec.name": "fp32"}))
    assert coord.active_sites == frozenset()
    info = coord.join(JoinRequest("a", specs, stated=settings.stated(("sync", "codec"))))
    assert coord.active_sites == {"a"} and coord.global_sha256() == params_sha256(params)
    assert info.settings == settings.to_dict()  # what every site then uses


@pytest.mark.timeout(60)
def test_bad_models_and_devices_fail_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match=r"model.factory='no_such_module_xyz:f': cannot import module 'no_such_module_xyz'"):
        check_before_start(RunConfig(model=model_config("custom", factory="no_such_module_xyz:f")))
    with pytest.raises(ConfigError, match=r"returned int, which is not a torch.nn.Module"):
        check_before_start(RunConfig(model=model_config("custom", factory="tests.user_models:not_a_module")))
    with pytest.raises(ConfigError, match="init=site: θ₀ is sent whole by a one-rank site, and every site here is a torchrun group"):
        RunConfig(sites=2, layout="fsdp2", init=InitConfig(source="site"))
    with pytest.raises(ConfigError, match=r"tp=2 \(layout=tp2\): model=custom needs model.parallelize=package.module:function"):
        RunConfig(model=model_config("custom", factory="tests.user_models:mlp_lm"), layout="tp2")
    with pytest.raises(ConfigError, match=r"model.parallelize='tests.user_models:no_such_fn': module 'tests.user_models' has no attribute 'no_such_fn'"):
        custom = model_config("custom", factory="tests.user_models:mlp_lm", parallelize="tests.user_models:no_such_fn")
        check_before_start(RunConfig(model=custom, layout="tp2"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device=cuda: this machine has no usable CUDA GPU"):
            check_before_start(RunConfig(device="cuda"))


# ---- models the project does not know, through diloco-sim -------------------------------

SIM = ["sites=2", "rounds=2", "sync.every=3", "data.batch_size=4", "eval_every=1", "sim.timeout_s=150"]


@pytest.mark.timeout(200)
def test_model_custom_with_init_site_evaluated_by_the_sites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the user's factory module is importable in every process
    run = run_ok(tmp_path / "custom", *SIM, "model=custom", "model.factory=tests.user_models:mlp_lm", "model.kwargs={hidden:32}", "init=site", timeout=180)
    s, metrics = run.summary, run.metrics
    assert s["hashes_equal"] and s["rounds_committed"] == 2 and s["eval_by"] == "sites"
    assert s["params"] == sum(p.numel() for p in build_model(model_config("custom", factory="tests.user_models:mlp_lm", kwargs={"hidden": 32}), 0).parameters())
    for m in metrics:  # the sites' token-weighted held-out loss; bits per byte since the data are bytes
        assert m["eval_by"] == "sites" and m["eval_sites"] == ["0", "1"] and math.isclose(m["eval_bpb"], m["eval_loss"] / math.log(2))
    for w in run.workers().values():
        assert w["round_sha256"] == {str(m["round"]): m["global_sha256"] for m in metrics}
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]


@pytest.mark.timeout(200)
def test_model_hf_through_diloco_sim(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run = run_ok(tmp_path / "hf", *SIM, "model=hf", timeout=180)
    s, metrics = run.summary, run.metrics
    assert s["hashes_equal"] and s["rounds_committed"] == 2 and s["eval_by"] == "coordinator" and s["final_eval_loss"] > 0
    assert all(m["eval_by"] == "coordinator" for m in metrics)
    for w in run.workers().values():
        assert w["round_sha256"] == {str(m["round"]): m["global_sha256"] for m in metrics}


@pytest.mark.timeout(200)
def test_token_file_through_diloco_sim_reports_nats_not_bits_per_byte(tmp_path: Path) -> None:
    import numpy as np

    from diloco.data import shipped_corpus_files

    # The shipped corpus, as 16-bit token ids (here one id per byte, offset so no id is a byte value).
    raw = b"\n\n".join(p.read_bytes() for p in shipped_corpus_files()[:4])
    path = tmp_path / "train.bin"
    (np.frombuffer(raw, dtype=np.uint8).astype(np.uint16) + 256).tofile(path)
    tokens = ["data.format=tokens", f"data.path={path}", "data.dtype=uint16", "data.vocab_size=512", "+model.vocab_size=512"]
    run = run_ok(tmp_path / "tokens", *SIM, *tokens, timeout=180)
    s, metrics = run.summary, run.metrics
    assert s["hashes_equal"] and s["eval_by"] == "coordinator" and s["final_eval_bpb"] is None and s["final_eval_loss"] > 0
    assert all(m["eval_bpb"] is None and m["eval_loss"] > 0 for m in metrics)
    assert metrics[-1]["eval_loss"] < math.log(512)  # better than a uniform guess over the vocabulary


@pytest.mark.timeout(60)
def test_a_push_with_a_bad_evaluation_is_refused_and_changes_nothing() -> None:
    from diloco.types import SiteEval

    params = _params(0)
    coord = coordinator(params, CoordinatorConfig(total_rounds=2, min_sites=1, site_eval_every=1), sites=("a",))
    delta = {n: torch.full_like(p, 1e-3) for n, p in params.items()}
    for bad, why in (
        (SiteEval(round=0, loss=1.0, tokens=10), r"eval_round=0; committed rounds are 0..-1"),
        (SiteEval(round=-1, loss=1.0, tokens=10), "eval_round=-1"),
    ):
        with pytest.raises(CoordinatorError, match=why):
            push(coord, "a", 0, delta, tokens=5, eval=bad)
    assert coord.committed_rounds == 0 and coord.global_sha256() == params_sha256(params)
    push(coord, "a", 0, delta, tokens=5)
    for bad, why in ((SiteEval(round=0, loss=float("nan"), tokens=10), "eval_loss=nan"), (SiteEval(round=0, loss=1.0, tokens=0), "eval_tokens=0")):
        with pytest.raises(CoordinatorError, match=why):
            push(coord, "a", 1, delta, tokens=5, eval=bad)
    assert coord.committed_rounds == 1 and coord.site_eval(0) is None
    good = SiteEval(round=0, loss=2.0, tokens=10)
    push(coord, "a", 1, delta, tokens=5, eval=good)
    assert coord.site_eval(0) == {"loss": 2.0, "tokens": 10, "sites": ["a"]}
