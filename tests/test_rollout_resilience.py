"""The SGLang engine under stress, against a real SGLang server on the CPU: groups streamed as they complete,
abort, bad inputs, sglang-router in front, and a server killed mid-rollout (restarted, weights re-synced,
every sample exactly once, log-prob parity with the Megatron policy afterwards).

One server is shared by the whole module; the tests that kill it come last.
"""

import collections
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import save_with_tokenizer  # noqa: E402

from megatron_dapo.rollout.engine import SamplingParams  # noqa: E402
from megatron_dapo.rollout.router import SGLangRouter  # noqa: E402
from megatron_dapo.rollout.server_key import SERVER_KEY_ENV  # noqa: E402
from megatron_dapo.rollout.sglang_engine import HTTPStatusError, RolloutError, SGLangEngine  # noqa: E402
from megatron_dapo.rollout.sglang_server import ServerError, SGLangServer, SGLangServerConfig, post_json  # noqa: E402
from megatron_dapo.weight_sync.server_calls import generation_paused  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["What is 3 plus 4?", "Compute 12 times 3.", "If x + 2 = 5 then", "A triangle has angles",
           "Divide 81 by 9", "The sum of the first", "What is", "Compute"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The server requires a key, as a run's do: every call of these tests goes with it."""
    root = tmp_path_factory.mktemp("resilience")
    tokenizer = save_with_tokenizer(root / "model")
    config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=8192,
                                startup_timeout_s=300)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SERVER_KEY_ENV, "test-key-" + os.urandom(8).hex())
        with SGLangEngine.launch([config], root, use_router=False) as launched:
            yield launched.servers[0].process, [tokenizer.encode(p) for p in PROMPTS], root


def kill(server: SGLangServer) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)  # the server and its scheduler / detokenizer: no clean exit


def counted(engine: SGLangEngine) -> list:
    """Record (server URL, request id) of every /generate call the engine sends."""
    calls, post = [], engine._post_group

    async def post_and_count(server, index, prompt, n, params, rid):
        calls.append((server.url, rid))
        return await post(server, index, prompt, n, params, rid)

    engine._post_group = post_and_count
    return calls


def check_group(group, n, max_new_tokens):
    assert len(group) == n and len({s.prompt_index for s in group}) == 1
    for s in group:
        assert 1 <= len(s.output_ids) <= max_new_tokens and len(s.logprobs) == len(s.output_ids)
        assert s.finish_reason in ("stop", "length") and all(lp <= 0 for lp in s.logprobs)


def test_stream_hands_out_every_group_exactly_once(setup):
    server, prompts, _ = setup
    engine = SGLangEngine(server.url, max_in_flight=3)
    calls = counted(engine)
    groups = list(engine.stream(prompts, 3, SamplingParams(max_new_tokens=24)))
    for g in groups:
        check_group(g, 3, 24)
    assert sorted(g[0].prompt_index for g in groups) == list(range(len(prompts)))
    assert len(calls) == len(prompts)  # one call per group, none repeated
    ordered = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8))
    assert [g[0].prompt_index for g in ordered] == list(range(len(prompts)))


def test_abort_ends_the_stream_and_cancels_the_rest_on_the_server(setup):
    server, prompts, _ = setup
    engine = SGLangEngine(server.url, max_in_flight=3)
    calls = counted(engine)
    stream = engine.stream(prompts * 4, 4, SamplingParams(max_new_tokens=64, ignore_eos=True))
    got = []
    for group in stream:
        got.append(group)
        if len(got) == 2:
            sent_before_abort = len(calls)
            stream.abort()
    assert len(got) == 2 and list(stream) == []
    stream.abort()  # a second abort is harmless
    stream.finished.result(timeout=120)  # no call of the stream left in flight
    # Only calls already in flight (at most max_in_flight) may still have gone out after the abort.
    assert len(calls) <= sent_before_abort + 3 < 32
    # Calls cut off by the abort left nothing queued or running on the server, and it still serves.
    assert engine.healthy()
    after = engine.generate(prompts[:2], 2, SamplingParams(max_new_tokens=8))
    assert [len(g) for g in after] == [2, 2]


def test_cancelled_groups_are_aborted_never_retried_and_never_handed_out(setup):
    server, prompts, _ = setup
    engine = SGLangEngine(server.url, max_in_flight=3)
    calls, aborted, abort = counted(engine), [], engine._abort
    engine._abort = lambda in_flight: aborted.extend(rid for _, rids in in_flight for rid in rids) or abort(in_flight)
    stream = engine.stream(prompts, 2, SamplingParams(max_new_tokens=64, ignore_eos=True))
    while not any("-p1-" in rid for _, rid in calls):  # prompt 1 is in flight (0, 1, 2 go first)
        time.sleep(0.01)
    stream.abort([1, 6])  # 6 is not sent yet
    groups = list(stream)
    assert sorted(g[0].prompt_index for g in groups) == [0, 2, 3, 4, 5, 7]
    for g in groups:
        check_group(g, 2, 64)
    stream.finished.result(timeout=120)
    sent = sorted(rid.split("-", 2)[2] for _, rid in calls)
    assert sent == ["p0-a0", "p1-a0", "p2-a0", "p3-a0", "p4-a0", "p5-a0", "p7-a0"]  # 1 not sent again, 6 never
    assert [rid.split("-", 2)[2] for rid in aborted] == ["p1-a0_0", "p1-a0_1"]  # on the server
    assert stream.resubmitted == 0 and engine.healthy()


def test_transient_failures_are_retried_with_the_whole_group(setup):
    server, prompts, _ = setup
    engine = SGLangEngine(server.url, max_in_flight=4, retry_backoff_s=0.1)
    post, failed = engine._post_group, []

    async def flaky(srv, index, prompt, n, params, rid):  # every group's first call is cut off, once by a 503
        if not rid.endswith("-a0"):
            return await post(srv, index, prompt, n, params, rid)
        failed.append(rid)
        if len(failed) == 1:
            raise HTTPStatusError(503, "Service Unavailable")
        raise ConnectionResetError("connection reset by peer")

    engine._post_group = flaky
    stream = engine.stream(prompts, 3, SamplingParams(max_new_tokens=12))
    groups = list(stream)
    counts = collections.Counter(s.prompt_index for g in groups for s in g)
    assert counts == {i: 3 for i in range(len(prompts))}
    assert len(failed) == len(prompts) and stream.resubmitted == len(prompts) and engine.restarts == 0

    async def always_reset(*args):
        raise ConnectionResetError("connection reset by peer")

    engine = SGLangEngine(server.url, max_attempts=2, retry_backoff_s=0.1)
    engine._post_group = always_reset
    with pytest.raises(RolloutError, match=r"failed 2 times \(max_attempts\).*connection reset"):
        engine.generate(prompts[:1], 2, SamplingParams(max_new_tokens=8))


def test_a_call_without_the_run_key_is_refused_and_the_key_is_not_on_the_command_line(setup):
    server, prompts, root = setup
    key = os.environ[SERVER_KEY_ENV]
    assert key not in " ".join(psutil.Process(server.proc.pid).cmdline())  # `ps` shows every user the command
    for endpoint, payload in [("/generate", {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}}),
                              ("/update_weights_from_disk", {"model_path": str(root / "model")}),
                              ("/pause_generation", {})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            request = urllib.request.Request(f"{server.url}{endpoint}", data=json.dumps(payload).encode(),
                                             headers={"Content-Type": "application/json", **headers})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 401, endpoint
    assert post_json(f"{server.url}/generate", {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}},
                     60)["meta_info"]["completion_tokens"] >= 1  # with the key
    assert server.healthy()  # /health stays open: liveness probes need no key


def test_bad_inputs_give_clear_errors(setup):
    server, prompts, _ = setup
    with pytest.raises(ValueError, match="servers"):
        SGLangEngine([])
    with pytest.raises(ValueError, match="http://"):
        SGLangEngine("127.0.0.1:30000")
    with pytest.raises(ValueError, match="max_in_flight"):
        SGLangEngine(server.url, max_in_flight=0)
    with pytest.raises(ValueError, match="max_server_restarts"):
        SGLangEngine(server.url, max_server_restarts=-1)
    engine = SGLangEngine(server.url)
    params = SamplingParams(max_new_tokens=8)
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected a non-empty"):
        engine.stream([prompts[0], []], 2, params)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids"):
        engine.stream([[5, -1]], 2, params)
    with pytest.raises(ValueError, match="n: the group size"):
        engine.stream(prompts, 0, params)
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.stream(prompts, 2, {"max_new_tokens": 8})
    with pytest.raises(ValueError, match="rollout.max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    # The server refuses a prompt longer than the model's context: named, not retried, not hidden.
    with pytest.raises(RolloutError, match=r"refused the group of prompt 1 \(400\).*context"):
        engine.generate([prompts[0], [5] * 500], 2, params)
    assert engine.healthy()


def test_groups_are_spread_over_several_servers(setup):
    server, prompts, _ = setup
    urls = [server.url, server.url.replace("127.0.0.1", "localhost")]  # two addresses of the one server
    engine = SGLangEngine(urls, max_in_flight=4)
    calls = counted(engine)
    groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12))
    assert [g[0].prompt_index for g in groups] == list(range(len(prompts)))
    assert len(calls) == len(prompts) and {url for url, _ in calls} == set(urls)


def test_groups_through_sglang_router(setup):
    server, prompts, root = setup
    with SGLangRouter([server.url], root / "router.log") as router:
        engine = SGLangEngine(server.url, router=router, max_in_flight=4)
        groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12))
        assert [g[0].prompt_index for g in groups] == list(range(len(prompts)))
        for g in groups:
            check_group(g, 2, 12)
        stream = engine.stream(prompts * 2, 2, SamplingParams(max_new_tokens=64, ignore_eos=True))
        first = next(iter(stream))
        stream.abort()
        assert len(first) == 2 and list(stream) == []
        assert engine.healthy()


def test_weights_pushed_into_a_running_server_reach_the_responses_in_flight(setup):
    """Partial rollouts: generation paused (running requests retracted), new weights loaded under a new version
    (the cache flushed, as every sync route asks), generation goes on. A response in flight at the push keeps its
    first tokens' version and its later tokens carry the new one; its Sample says the oldest version (staleness
    counts from it)."""
    server, prompts, root = setup
    reset = post_json(f"{server.url}/update_weights_from_disk", {"model_path": str(root / "model"),
                                                                 "weight_version": "0"}, 300)
    assert reset["success"], reset
    engine = SGLangEngine(server.url, max_in_flight=len(prompts))
    long = SamplingParams(max_new_tokens=64, ignore_eos=True)
    # SGLang's testing knob (a sleep before each forward pass) holds the responses in flight for 3 s at least, so
    # that the push lands inside them however loaded this machine is; a short group sent after the long ones is
    # the clock: once it is back, they are decoding.
    post_json(f"{server.url}/slow_down", {"forward_sleep_time": 0.05}, 60)
    try:
        running = engine.stream(prompts[:-1], 2, long)
        list(engine.stream(prompts[-1:], 2, SamplingParams(max_new_tokens=4, ignore_eos=True)))
        with generation_paused([server.url], 300):
            out = post_json(f"{server.url}/update_weights_from_disk",
                            {"model_path": str(root / "model"), "weight_version": "1"}, 300)
            assert out["success"], out
        spanned = [s for group in running for s in group]
    finally:
        post_json(f"{server.url}/slow_down", {"forward_sleep_time": None}, 60)
    assert len(spanned) == 2 * (len(prompts) - 1) and all(len(s.output_ids) == 64 for s in spanned)
    for s in spanned:
        (old, start, cut), (new, cut2, end) = s.version_spans
        assert (old, new, start, end) == ("0", "1", 0, 64) and cut == cut2 and 0 < cut < 64, s.version_spans
        assert s.weight_version == "0"
    after = [s for group in engine.stream(prompts[:1], 2, long) for s in group]
    assert all(s.version_spans == (("1", 0, 64),) and s.weight_version == "1" for s in after)
    engine.close()


# Last: these kill the shared server.
def test_a_server_killed_mid_rollout_is_restarted_and_no_sample_is_lost(setup, tmp_path):
    server, prompts, root = setup
    resynced = []

    def on_server_restart(url):  # the trainer reloads its latest synced weights here
        out = post_json(f"{url}/update_weights_from_disk", {"model_path": str(root / "model"),
                                                            "weight_version": "resynced"}, 300)
        assert out["success"], out
        resynced.append(url)

    engine = SGLangEngine(server, max_in_flight=4, on_server_restart=on_server_restart)
    # Not temperature 1: the log-probs compared below are the policy's at the sampling temperature.
    stream = engine.stream(prompts, 4, SamplingParams(temperature=0.7, max_new_tokens=64))
    groups = []
    for group in stream:
        groups.append(group)
        if len(groups) == 1:
            kill(server)  # 3 groups in flight, 4 not sent yet
    for g in groups:
        check_group(g, 4, 64)
    counts = collections.Counter(s.prompt_index for g in groups for s in g)
    assert counts == {i: 4 for i in range(len(prompts))}
    assert resynced == [server.url] and engine.restarts == 1 and stream.resubmitted >= 1
    versions = [{s.weight_version for s in g} for g in groups]
    assert all(len(v) == 1 for v in versions)
    assert sum(v == {"resynced"} for v in versions) >= 3  # at least the groups not yet sent at the kill

    samples = [{"prompt": prompts[s.prompt_index], "output": s.output_ids, "logprobs": s.logprobs}
               for g in groups for s in g]
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    torchrun("rollout_parity_worker.py", 1, str(tmp_path / "out.json"), str(root / "model"), "1",
             f"{tmp_path / 'samples.json'}:0.7")
    result = json.loads((tmp_path / "out.json").read_text())["0.7"]
    assert result["tokens"] == sum(len(s["output"]) for s in samples)
    assert result["max_abs_diff"] < 1e-4


def test_a_stopped_server_mid_rollout_counts_as_dead_within_its_health_deadline(setup, caplog):
    """SIGSTOP: the server is there but answers nothing. Its calls would wait out the request timeout (600 s);
    the engine's watchdog finds it stuck within health_timeout_s, and it is restarted, resynced, its groups sent
    again: every sample exactly once."""
    server, prompts, root = setup
    resynced = []

    def on_server_restart(url):
        assert post_json(f"{url}/update_weights_from_disk", {"model_path": str(root / "model"),
                                                             "weight_version": "resynced"}, 300)["success"]
        resynced.append(time.monotonic())

    # SGLang's /health is a one-token generation: behind the re-sent groups, with the other lane's runs on the
    # same 2 cores, the restarted server took over 3 s to answer it, and was found stuck a second time.
    health_s = 8.0
    engine = SGLangEngine(server, max_in_flight=4, health_timeout_s=health_s, request_timeout_s=600.0,
                          on_server_restart=on_server_restart)
    groups = []
    with caplog.at_level("WARNING", logger="megatron_dapo.rollout.sglang_engine"):
        for group in engine.stream(prompts, 4, SamplingParams(max_new_tokens=64)):
            groups.append(group)
            if len(groups) == 1:
                os.killpg(server.proc.pid, signal.SIGSTOP)  # 3 groups in flight, 4 not sent yet
                stopped, stopped_at = time.monotonic(), time.time()
    (stuck,) = [r for r in caplog.records if "is stuck" in r.getMessage()]
    detected_s = stuck.created - stopped_at
    print(f"stopped server: found stuck after {detected_s:.1f} s, back with the weights after "
          f"{resynced[0] - stopped:.1f} s")
    assert detected_s < health_s + 3.0  # the deadline and one probe interval (2 s here), with room for a busy CPU
    counts = collections.Counter(s.prompt_index for g in groups for s in g)
    assert counts == {i: 4 for i in range(len(prompts))}
    assert len(resynced) == 1 and engine.restarts == 1 and server.alive() and server.healthy()
    assert sum({s.weight_version for s in g} == {"resynced"} for g in groups) >= 3
    engine.close()


def test_a_server_given_by_url_is_waited_for_then_given_up_on(setup):
    server, prompts, _ = setup
    engine = SGLangEngine(server.url, max_in_flight=2, on_server_restart=lambda url: None)
    kill(server)
    back = threading.Thread(target=server.restart)  # someone else brings it back on the same address
    back.start()
    groups = engine.generate(prompts[:4], 2, SamplingParams(max_new_tokens=8))
    back.join()
    assert [len(g) for g in groups] == [2] * 4 and engine.restarts == 1

    strict = SGLangEngine(server, max_server_restarts=0)
    kill(server)
    with pytest.raises(ServerError, match="max_server_restarts=0"):
        strict.generate(prompts[:2], 2, SamplingParams(max_new_tokens=8))
