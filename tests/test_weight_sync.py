"""Weight sync from a TP x PP sharded Megatron policy into a real SGLang server, through each route.

One torchrun run per layout does one optimizer step, then for every route puts the server back to the
original weights, syncs, and samples again; the cases below read that run's record for their route.
The distributed route is also taken across a server restart, and the tensor route in the colocated
order (release the server's memory, resume its weights, sync from the trainer rank on its node, resume
its caches); bucket packing and bad settings are checked without a server.
"""

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import hf_model, save_with_tokenizer  # noqa: E402

from megatron_dapo.checkpoint.hf_mapping import hf_names, hf_shape, megatron_names  # noqa: E402
from megatron_dapo.config import ParallelConfig  # noqa: E402
from megatron_dapo.policy.hf_config import model_spec_from_hf  # noqa: E402
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig, post_json  # noqa: E402
from megatron_dapo.weight_sync import ROUTES, buckets, make_weight_syncer  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
BUCKET_MB = 0.05  # the tiny model spreads over many buckets, and its embedding is bigger than one


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    save_with_tokenizer(root / "model")
    config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=8192,
                                startup_timeout_s=300)
    with SGLangServer(config, root / "server.log") as srv:
        yield srv, root


@pytest.fixture(scope="module")
def synced(server, tmp_path_factory):
    """layout -> the worker's record (run once per layout, on demand)."""
    srv, root = server
    records = {}

    def run(layout: str) -> dict:
        if layout not in records:
            tp, pp = LAYOUTS[layout]
            reset = post_json(f"{srv.url}/update_weights_from_disk",
                              {"model_path": str(root / "model"), "weight_version": "0"}, 300)
            assert reset["success"], reset
            work = tmp_path_factory.mktemp(f"sync-{layout}")
            torchrun("weight_sync_worker.py", tp * pp, str(work / "out.json"), str(root / "model"), srv.url,
                     str(work), str(tp), str(pp), ",".join(ROUTES), str(BUCKET_MB))
            records[layout] = json.loads((work / "out.json").read_text())
        return records[layout]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("route", ROUTES)
def test_after_a_step_and_a_sync_sglang_samples_from_the_new_policy(synced, layout, route):
    r = synced(layout)
    assert r["before"] < 1e-4 and r["versions_before"] == ["0"], r
    assert r["stale"] > 1e-3, "the step did not change the policy"
    s = r["routes"][route]
    # Put back to the original weights first, the server does not sample from the new policy ...
    assert s["versions_reset"] == ["0"] and s["reset"] > 1e-3, s
    # ... and after the sync it does, tagged with the new step.
    assert s["samples_after"] == 16 and s["versions_after"] == ["1"], s
    assert s["after"] < 1e-4, s
    if route != "disk":  # every tensor sent exactly once (disk counts its files)
        assert s["bytes"] == buckets.model_bytes(_spec(), torch.float32)


def _spec():
    return model_spec_from_hf(hf_model("qwen2")[1])


def test_buckets_are_bounded_ordered_and_exact(monkeypatch):
    spec = _spec()
    g = torch.Generator().manual_seed(0)
    names = [n for m in megatron_names(spec) for n in hf_names(m, spec)]
    tensors = [(n, torch.randn(hf_shape(n, spec), generator=g)) for n in names]
    monkeypatch.setattr(buckets, "iter_hf_tensors", lambda *a: iter(tensors))
    monkeypatch.setattr(buckets.dist, "get_rank", lambda: 0)
    bucket_bytes = 40_000
    sizes = [t.numel() * 4 for _, t in tensors]
    assert max(sizes) > bucket_bytes > min(sizes)  # both kinds of bucket below
    seen, lasts, buffers = [], [], set()
    for b in buckets.iter_hf_buckets(None, spec, None, bucket_bytes):
        assert b.nbytes <= bucket_bytes or len(b.names) == 1
        seen += [(n, t.clone()) for n, t in b.named_tensors()]
        lasts.append(b.last)
        if b.nbytes <= bucket_bytes:
            buffers.add(b.flat.untyped_storage().data_ptr())
    assert [n for n, _ in seen] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen, tensors))
    assert lasts[-1] and not any(lasts[:-1])
    assert len(buffers) == 1  # one buffer, refilled


def test_bad_routes_and_sizes_are_refused_by_name(tmp_path):
    spec, parallel = _spec(), ParallelConfig(device="cpu")
    with pytest.raises(ValueError, match="rollout.weight_sync must be one of distributed, tensor, disk; got 'nccl'"):
        make_weight_syncer("nccl", ["http://127.0.0.1:1"], spec, parallel, {}, work_dir=tmp_path)
    with pytest.raises(ValueError, match="no server URLs"):
        make_weight_syncer("tensor", [], spec, parallel, {})
    with pytest.raises(ValueError, match="rollout.weight_sync_bucket_mb must be > 0"):
        make_weight_syncer("distributed", ["http://127.0.0.1:1"], spec, parallel, {}, bucket_mb=0)
    with pytest.raises(ValueError, match="work_dir is required for the disk route"):
        make_weight_syncer("disk", ["http://127.0.0.1:1"], spec, parallel, {})


@pytest.mark.slow
def test_colocated_release_resume_and_sync_from_the_servers_node(server, tmp_path):
    srv, root = server
    torchrun("colocated_sync_worker.py", 2, str(tmp_path / "out.json"), str(root / "model"), srv.url, str(BUCKET_MB))
    r = json.loads((tmp_path / "out.json").read_text())
    spec = _spec()
    names = [n for m in megatron_names(spec) for n in hf_names(m, spec)]
    for received in r["received"]:  # with two receivers, each rank gets every tensor, exactly
        assert [n for n, _ in received] == names and max(d for _, d in received) == 0.0
    # the server is on rank 1's "node": rank 1 alone receives the tensors and pushes them, all of them once
    assert r["pushers"] == [1] and r["pushed"] == [None, buckets.model_bytes(spec, torch.float32)], r
    assert r["stale"] > 1e-3, "the step did not change the policy"
    assert r["samples_after"] == 16 and r["versions_after"] == ["1"] and r["after"] < 1e-4, r
    assert set(r["seconds"]) == {"release", "resume_weights", "sync", "resume_caches"}


# Last among the server tests: it restarts the shared server.
@pytest.mark.slow
def test_the_distributed_route_leaves_out_a_server_that_is_down_and_forms_its_group_anew_once_it_is_back(
        server, tmp_path):
    srv, root = server
    failures = []

    def restart_when_synced():
        try:
            deadline = time.monotonic() + 600
            while not (tmp_path / "SYNCED").exists() and time.monotonic() < deadline:
                time.sleep(0.5)
            srv.stop()
            (tmp_path / "STOPPED").touch()
            while not (tmp_path / "SKIPPED").exists() and time.monotonic() < deadline:
                time.sleep(0.5)
            srv.start().wait_healthy()
        except Exception as e:  # reported below; the worker then fails on its own
            failures.append(e)
        (tmp_path / "RESTARTED").touch()

    restarter = threading.Thread(target=restart_when_synced, daemon=True)
    restarter.start()
    torchrun("weight_sync_restart_worker.py", 1, str(tmp_path / "out.json"), str(root / "model"), srv.url,
             str(tmp_path))
    restarter.join()
    assert not failures, failures
    r = json.loads((tmp_path / "out.json").read_text())
    assert r["skipped_members"] == [], r  # the sync with the server down pushed nowhere and left the group
    assert r["versions_first"] == ["1"] and r["first"] > 1e-3, r  # sampled before the second change
    assert r["versions_restarted"] != ["1"] and r["restarted"] > 1e-3, r  # the restart lost the synced weights
    assert r["versions_after"] == ["2"] and r["after"] < 1e-4, r
