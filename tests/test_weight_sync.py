"""Weight sync from a TP x PP (or CP) split Megatron policy into a real SGLang server, through each route.

One torchrun run does, for each layout over the same 2 ranks, one optimizer step, then for every route puts
the server back to the original weights, syncs, and samples again; the cases below read that run's record for
their layout and route.
The distributed route is also taken across a server restart and across a server killed in the middle
of a sync, and the tensor route in the colocated order (release the server's memory, resume its weights,
sync from the trainer rank on its node, resume its caches); bucket packing, bad settings and a failed
push's walk are checked without a server.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import sglang_server_as_started
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import hf_model  # noqa: E402

from megatron_dapo.checkpoint.hf_mapping import hf_names, hf_shape, megatron_names  # noqa: E402
from megatron_dapo.config import ParallelConfig  # noqa: E402
from megatron_dapo.policy.hf_config import model_spec_from_hf  # noqa: E402
from megatron_dapo.rollout.server_key import auth_headers  # noqa: E402
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig  # noqa: E402
from megatron_dapo.weight_sync import ROUTES, buckets, make_weight_syncer, server_calls  # noqa: E402

LAYOUTS = ("tp2", "pp2", "cp2")  # each over the same 2 ranks
BUCKET_MB = 0.05  # the tiny model spreads over many buckets, and its embedding is bigger than one


@pytest.fixture(scope="module")
def server(shared_sglang):
    srv, _, root = sglang_server_as_started(shared_sglang)
    return srv, root


@pytest.fixture(scope="module")
def synced(server, tmp_path_factory):
    """layout -> the worker's record: every layout in one start of the ranks."""
    srv, root = server
    work = tmp_path_factory.mktemp("sync")
    torchrun("weight_sync_worker.py", 2, str(work / "out.json"), str(root / "model"), srv.url, str(work),
             ",".join(LAYOUTS), ",".join(ROUTES), str(BUCKET_MB))
    return json.loads((work / "out.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("route", ROUTES)
def test_after_a_step_and_a_sync_sglang_samples_from_the_new_policy(synced, layout, route):
    r = synced[layout]
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


def test_the_tensor_route_takes_servers_that_load_through_our_loader_and_refuses_others(server, monkeypatch):
    """Our servers load the tensor route's buckets through server_weight_loader, whose answer means the bucket was
    read (SGLang answers before its copies out of the shared buffer have run); one started without it is refused
    by name, before anything is pushed."""
    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.rollout.server_weight_loader import LOADER
    from megatron_dapo.weight_sync import tensor

    srv, _ = server
    assert server_calls.server_info(srv.url)["custom_weight_loader"] == [LOADER]
    monkeypatch.setattr(tensor, "server_info", lambda url: {"tp_size": 1, "custom_weight_loader": []})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(server_calls.WeightUpdateError,
                           match=f"http://127.0.0.1:1: started without --custom-weight-loader {LOADER}"):
            tensor.TensorSyncer(["http://127.0.0.1:1"], _spec(), ParallelConfig(device="cpu"), 2**20)
    finally:
        dist.destroy_process_group()


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




def test_the_shm_manager_of_the_tensor_route_holds_no_output_of_the_trainer(tmp_path):
    """On the CPU the tensor route starts torch's shm manager. A rank that ends without its exit handlers (a stuck
    rank's os._exit, a SIGKILL) leaves the manager running while the servers hold it: holding the rank's stderr,
    it kept a SLURM step's output open, and slurmstepd waited 60 s before it ended the failed step."""
    import subprocess

    script = ("import os, psutil\n"
              "from megatron_dapo.weight_sync.tensor import shared_buffer, use_file_system_sharing\n"
              "use_file_system_sharing()\n"
              "import torch; shared_buffer(64, torch.device('cpu'))\n"
              "(manager,) = [c for c in psutil.Process().children(recursive=True) if c.name() == 'torch_shm_manager']\n"
              "print(os.readlink(f'/proc/{manager.pid}/fd/2'))\n"
              "print(os.readlink('/proc/self/fd/2'))\n")
    with open(tmp_path / "stderr", "w") as err:
        out = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True,
                             check=True, timeout=120).stdout.split()
    managers_stderr, ours = out
    assert ours == str(tmp_path / "stderr") and managers_stderr != ours


@contextmanager
def answering(reply: dict):
    """An HTTP endpoint on a free port answering every POST with `reply`, recording the paths posted to: a
    server up for the calls a test makes before it shuts it down (the port then refuses, as a killed one's)."""
    posted = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            posted.append(self.path)
            body = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", posted, http
    finally:
        http.shutdown()
        http.server_close()


def test_a_server_killed_while_paused_for_a_live_push_is_not_asked_to_go_on(caplog):
    """rollout.mode async pushes the weights while the servers sample: a server killed between the pause and the
    continue is down (its restart is not paused), not a failed sync that ends the run."""
    with answering({"success": True}) as (killed, killed_posts, http), \
            answering({"success": True}) as (alive, alive_posts, _):
        with server_calls.generation_paused([killed, alive, "http://127.0.0.1:1"], 5) as up:
            assert up == [killed, alive]  # the one down before the pause is left out of the update
            http.shutdown()
            http.server_close()  # killed in the update
    assert killed_posts == ["/pause_generation"] and alive_posts == ["/pause_generation", "/continue_generation"]
    assert f"{killed}/continue_generation: server unreachable" in caplog.text


def test_the_disk_route_leaves_out_a_server_killed_before_its_load_and_raises_a_refusal(monkeypatch, tmp_path,
                                                                                         caplog):
    """The servers load the exported folder: one that does not answer is down (the rollout engine restarts it and
    the trainer resyncs it then), left out with a warning; one that answers with a refusal fails the sync."""
    from megatron_dapo.weight_sync import disk

    monkeypatch.setattr(disk, "export_hf_checkpoint", lambda model, spec, parallel, folder, hf_config: folder.mkdir())
    monkeypatch.setattr(disk.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(disk.dist, "barrier", lambda: None)
    dead = "http://127.0.0.1:1"
    with answering({"success": True}) as (alive, posted, _):
        syncer = disk.DiskSyncer([dead, alive], None, None, {}, tmp_path)
        assert syncer.sync(None, "1") is not None
        assert posted == ["/update_weights_from_disk"] and syncer.loaded == tmp_path / "weights-1"
    assert f"{dead}/update_weights_from_disk: server unreachable" in caplog.text
    with answering({"success": False, "message": "shapes differ"}) as (refusing, _, _):
        with pytest.raises(server_calls.WeightUpdateError, match="update_weights_from_disk: shapes differ"):
            disk.DiskSyncer([refusing], None, None, {}, tmp_path).sync(None, "2")


def test_a_failed_push_walks_on_ends_the_update_meets_the_barrier_and_raises_its_cause(monkeypatch):
    """The other trainer ranks' gathers need rank 0 to walk every bucket, and the servers need their update
    ended, even when a push fails; the error raised is the push's, not that of ending the update on a dead
    server."""
    calls, walked, pushed = [], [], []
    dead = "http://127.0.0.1:2"

    def call_all(urls, endpoint, payload, timeout_s):
        calls.append(endpoint)
        if endpoint == "/end_weight_update" and dead in urls:
            raise server_calls.ServerUnreachable(f"{dead}/end_weight_update: server unreachable: refused")

    def walk():
        for i in range(1, 6):
            walked.append(i)
            yield buckets.Bucket([f"w{i}"], [(1,)], torch.float32, torch.zeros(4, dtype=torch.uint8), last=i == 5)

    def push(bucket):
        if bucket.names == ["w2"]:
            raise server_calls.WeightUpdateError(f"bucket 2: {dead}/update_weights_from_distributed: refused")
        pushed.append(bucket.names[0])

    monkeypatch.setattr(server_calls, "call_all", call_all)
    monkeypatch.setattr(server_calls.dist, "barrier", lambda: calls.append("barrier"))
    with pytest.raises(server_calls.WeightUpdateError, match="bucket 2: .*/update_weights_from_distributed"):
        server_calls.push_buckets(["http://127.0.0.1:1", dead], walk(), push, 1.0)
    assert walked == [1, 2, 3, 4, 5] and pushed == ["w1"]  # walked to the end, pushed no more after the failure
    assert calls == ["/begin_weight_update", "/end_weight_update", "barrier"]

@pytest.mark.slow
def test_an_update_between_batches_waits_until_the_server_has_no_request_left(server):
    """one_step_off's sync once the next batch is full: the groups it no longer needs were aborted, but their
    requests can still be on a server for a moment, and an update then loads the weights but not the cache flush
    (SGLang: HTTP 400; a SLURM run met it and failed). servers_idle waits for the server to be idle and flushes,
    and the update goes through."""
    srv, root = server
    update = {"model_path": str(root / "model"), "weight_version": "0", "flush_cache": True}
    streamed = urllib.request.Request(  # 8 x 80 tokens, streamed: its first chunk says the server is decoding
        f"{srv.url}/generate", headers={"Content-Type": "application/json", **auth_headers()},
        data=json.dumps({"input_ids": [8, 9], "stream": True,
                         "sampling_params": {"n": 8, "max_new_tokens": 80, "ignore_eos": True}}).encode())
    with urllib.request.urlopen(streamed, timeout=300) as stream:
        assert stream.readline().startswith(b"data:")
        # Held on the server (paused in place): still there when the update comes, however fast this CPU decodes.
        server_calls.call(srv.url, "/pause_generation", {"mode": "in_place"}, 60)
        with pytest.raises(server_calls.WeightUpdateError, match="cache was not flushed because requests are still"):
            server_calls.call(srv.url, "/update_weights_from_disk", update, 300)
        with ThreadPoolExecutor(1) as pool:
            idle = pool.submit(server_calls.servers_idle, [srv.url], 300)
            time.sleep(1.0)
            assert not idle.done()  # it waits for the request
            server_calls.call(srv.url, "/continue_generation", {}, 60)
            assert idle.result() == [srv.url]
        assert stream.read().rstrip().endswith(b"data: [DONE]")  # it ran to its end meanwhile
    server_calls.call(srv.url, "/update_weights_from_disk", update, 300)


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



# After the restart test: the shared server is the survivor here, left with the last version synced.
@pytest.mark.slow
def test_a_server_killed_in_the_middle_of_a_distributed_sync_fails_it_fast_and_the_next_sync_recovers(
        server, tmp_path):
    """Two servers; the second, the victim, is SIGKILLed in bucket 3 of a sync, once while it waits in the
    bucket's broadcast and once just before the bucket's call (the worker's docstring has the details)."""
    srv, root = server
    timeout_s = 60  # rollout.weight_sync_timeout_s: a sync that waits on it instead of failing shows as >= 60 s
    config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=8192,
                                startup_timeout_s=300)
    points = ["broadcast", "call"]
    failures, restart_s = [], {}

    def restart_when_failed(victim):
        for point in points:
            try:
                deadline = time.monotonic() + 900
                while not (tmp_path / f"FAILED-{point}").exists() and time.monotonic() < deadline:
                    time.sleep(0.5)
                start = time.monotonic()
                victim.restart()  # on the same port
                restart_s[point] = time.monotonic() - start
            except Exception as e:  # reported below; the worker then fails on its own
                failures.append(e)
            (tmp_path / f"RESTARTED-{point}").write_text(str(victim.proc.pid if victim.proc else -1))

    with SGLangServer(config, tmp_path / "victim.log") as victim:
        restarter = threading.Thread(target=restart_when_failed, args=(victim,), daemon=True)
        restarter.start()
        torchrun("weight_sync_kill_worker.py", 1, str(tmp_path / "out.json"), str(root / "model"), victim.url,
                 srv.url, str(tmp_path), str(victim.proc.pid), str(timeout_s), timeout=900)
        restarter.join()
    assert not failures, failures
    r = json.loads((tmp_path / "out.json").read_text())
    for point in points:
        p = r[point]
        print(f"victim killed in bucket 3 ({point}): the sync failed {p['detect_s']:.2f} s after the kill "
              f"(whole sync {p['sync_s']:.2f} s), the survivor answered in {p['survivor_answers_s']:.2f} s; "
              f"the victim's restart took {restart_s[point]:.1f} s, then the next sync (group formed anew) "
              f"{p['recover_s']:.2f} s")
        error = p["error"]
        assert error is not None and error["is_weight_update_error"], (point, p)
        message = error["message"]
        # Names the dead server, the bucket and what failed (its call cut off or refused, or the broadcast when
        # that fails first), and the survivor left with part of the version.
        assert victim.url in message and "bucket 3" in message, (point, message)
        assert (f"{victim.url}/update_weights_from_distributed: server unreachable" in message
                or "the broadcast to the weight-update group" in message), (point, message)
        assert f"{srv.url} got part of version" in message, (point, message)
        assert p["detect_s"] < 10 and p["survivor_answers_s"] < 10, (point, p)  # far from the 60 s timeout
        for name in ("victim", "survivor"):  # recovered: both servers have the new weights
            assert p[name]["versions_after"] == [p["version"]] and p[name]["after"] < 1e-4, (point, name, p)


def test_a_dropped_weight_group_releases_the_servers_left_in_its_broadcast(tmp_path):
    """gloo, without servers: trainer rank 0 (here) and two server ranks. After two buckets, rank 1 is killed;
    the third bucket's broadcast fails, the group is dropped (as after a failed push), and rank 2, which waits in
    a broadcast for data that will not come, is released at once by rank 0's sockets closing, not after the
    group's 30 s timeout. The failed push's error lives on (its traceback holds the broadcast's completion
    future): nothing it holds may keep the collective, and with it the gloo context, alive. Rank 0 sends the
    third bucket once it has seen rank 1 gone (CI saw a third bucket reach rank 2 before failing on rank 1)."""
    import datetime

    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.weight_sync import distributed

    port, name = free_port(), "weight_group_drop_test"
    peers = [subprocess.Popen([sys.executable, str(Path(__file__).parent / "distributed" / "weight_group_peer.py"),
                               "127.0.0.1", str(port), str(rank), "3", name, "2", str(tmp_path / f"rank{rank}.json")])
             for rank in (1, 2)]
    try:
        group = distributed._join_as_rank0("gloo", "127.0.0.1", port, 3, name, datetime.timedelta(seconds=30))
        bucket = torch.ones(4096)
        for _ in range(2):  # the buckets before, each awaited as _push awaits them
            work = dist.broadcast(bucket, group=group, group_src=0, async_op=True)
            wait([distributed._completion(work)])
            work.wait()
        os.kill(peers[0].pid, signal.SIGKILL)
        peers[0].wait()
        time.sleep(0.5)  # rank 0's transport sees rank 1's sockets close
        work = dist.broadcast(bucket, group=group, group_src=0, async_op=True)
        sent = distributed._completion(work)
        wait([sent], timeout=30)
        assert sent.exception() is not None  # the broadcast to the dead rank failed
        syncer = object.__new__(distributed.DistributedSyncer)  # only its group, to drop it
        syncer.group, syncer.broken = group, False
        held = [work]
        del work, group
        dropped = time.monotonic()
        syncer._drop_group(held)
        peers[1].wait(timeout=60)
        released_s = time.monotonic() - dropped
    finally:
        for p in peers:
            p.kill()
    result = json.loads((tmp_path / "rank2.json").read_text())
    assert released_s < 10 and result["waited_s"] < 10, (released_s, result)  # measured: 0.1 s



def test_a_restarted_server_reloads_the_folder_the_others_serve_under_that_folders_version(monkeypatch, tmp_path):
    """The disk route: a server restarted while the next batch is sampled (rollout.mode one_step_off, after the
    policy has trained one step further) loads the folder the other servers serve, and its samples carry that
    folder's version, not the policy's newer one."""
    from megatron_dapo.loop import weight_publisher
    from megatron_dapo.loop.progress import RunProgress
    from megatron_dapo.weight_sync.disk import DiskSyncer

    syncer = DiskSyncer(["http://127.0.0.1:1"], None, None, {}, tmp_path)
    syncer.loaded, syncer.loaded_version = tmp_path / "weights-3", "3"
    calls = []
    monkeypatch.setattr(weight_publisher, "call_all", lambda *args: calls.append(args))
    publisher = weight_publisher.WeightPublisher(syncer, ["http://127.0.0.1:1"], None, RunProgress(4), timeout_s=5)
    assert publisher.reload("http://127.0.0.1:2")
    assert calls == [(["http://127.0.0.1:2"], "/update_weights_from_disk",
                      {"model_path": str(tmp_path / "weights-3"), "weight_version": "3"}, 5)]
