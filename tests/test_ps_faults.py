"""pycoll.ps under faults: bad declarations and requests, hand-made messages, a tag space
that wraps, corrupt checkpoints, a killed server. The wire format and the checkpoint
files in-process; the rest as whole jobs (tests/ps_job.py), a few seconds each."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from pycoll.ps import checkpoints as ckpt
from pycoll.ps import wire
from pycoll.ps.layout import mismatch
from test_ps import job

pytestmark = pytest.mark.timeout(180)
JOB = dict(servers=1, workers=2, policy="bsp")


# ---------------------------------------------------------------- in-process
def test_header_round_trips_and_every_truncation_is_refused():
    entries = [wire.Entry("w", "float32", 10, 0, 10), wire.Entry("bias é", "float64", 7, 2, 5)]
    raw = wire.encode(wire.PUSH, 3, 42, wire.encode_table(entries), 2, arg=5, waited=0.5,
                      npieces=1, nbytes=64)
    req = wire.parse(raw, tag_ub=2**20)
    assert (req.op, req.slot, req.request, req.arg, req.waited) == (wire.PUSH, 3, 42, 5, 0.5)
    assert req.entries == tuple(entries) and (req.npieces, req.nbytes) == (1, 64)
    for cut in range(len(raw)):
        with pytest.raises(wire.BadRequest, match="truncated|shorter"):
            wire.parse(raw[:cut], tag_ub=2**20)
    with pytest.raises(wire.BadRequest, match="not a pycoll.ps request"):
        wire.parse(b"\x80\x04pickle" + raw[9:], tag_ub=2**20)
    with pytest.raises(wire.BadRequest, match="slot 3; tags end at 20"):
        wire.parse(raw, tag_ub=20)
    bad_dtype = bytearray(raw)
    bad_dtype[wire.HEADER.size] = 200
    with pytest.raises(wire.BadRequest, match="dtype code 200"):
        wire.parse(bytes(bad_dtype), tag_ub=2**20)


def test_slots_are_reused_and_tags_never_pass_tag_ub():
    tag_ub = wire.TAG_BASE + 3 * wire.TAGS_PER_SLOT - 1
    slots = wire.Slots(tag_ub)
    taken = [slots.take() for _ in range(3)]
    assert taken == [0, 1, 2] and not slots.available()
    assert max(wire.tags(s)[-1] for s in taken) == tag_ub
    for _ in range(1000):                       # wrap around: always a freed one
        slots.give(taken.pop(0))
        taken.append(slots.take())
        assert len(set(taken)) == 3 and max(taken) <= 2
    slots.lose(taken.pop())                     # abandoned: never handed out again
    slots.give(taken.pop())
    assert slots.take() in (0, 1, 2) and not slots.available()
    with pytest.raises(ValueError, match="no tag slot"):
        wire.Slots(wire.TAG_BASE + 2)


def test_declaration_mismatches_name_the_key_and_both_sides():
    same = [["w", [4], "float32"], ["b", [2], "float64"]]
    assert mismatch([same, same, same]) is None
    text = mismatch([same, [["w", [2], "float64"], same[1]]])
    assert "key 'w' differently: worker 0 declares float32 [4], worker 1 float64 [2]" in text
    assert "worker 2 nothing" in mismatch([same, same, same[1:]])
    assert "key 'x'" in mismatch([same, same + [["x", [1], "float32"]]])
    assert "another order" in mismatch([same, same[::-1]])
    assert "['w'] more than once" in mismatch([same + same[:1], same])


def _save(directory, generation, job=JOB, value=1.0):
    p = np.full(5, value, np.float32)
    return ckpt.save(str(directory), 0, generation, job, [("w", "float32", 5, 0, 5)], [p],
                     [p * 2], [generation, generation], generation)


def test_checkpoint_files_are_checked_before_use(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2, value=3.0)
    state = ckpt.load(str(tmp_path), 0, 2, JOB)
    assert state.params[0].tolist() == [3.0] * 5 and state.momentum[0][0] == 6.0
    assert state.clocks == [2, 2] and state.keys == [("w", "float32", 5, 0, 5)]
    bin2, json2 = ckpt.paths(str(tmp_path), 0, 2)
    raw = bytearray(open(bin2, "rb").read())
    raw[3] ^= 0xFF
    open(bin2, "wb").write(raw)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(bin2) + ".*SHA-256.*corrupted"):
        ckpt.load(str(tmp_path), 0, 2, JOB)
    open(bin2, "wb").write(raw[:7])
    with pytest.raises(ckpt.CheckpointError, match="has 7 bytes.*truncated"):
        ckpt.load(str(tmp_path), 0, 2, JOB)
    good, bad = ckpt.scan(str(tmp_path), 0, JOB)   # what a server falls back to, and why
    assert list(good) == [1] and bin2 in bad[2]
    open(json2, "w").write('{"format": "pycoll.ps chec')
    with pytest.raises(ckpt.CheckpointError, match=re.escape(json2) + " is not valid JSON"):
        ckpt.load(str(tmp_path), 0, 2, JOB)
    with pytest.raises(ckpt.CheckpointError, match="workers = 2; this one has 3"):
        ckpt.load(str(tmp_path), 0, 1, dict(JOB, workers=3))
    manifest = json.load(open(ckpt.paths(str(tmp_path), 0, 1)[1]))
    manifest["keys"][0]["key"][1] = "float64"        # a forged layout
    open(ckpt.paths(str(tmp_path), 0, 1)[1], "w").write(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="layout fingerprint"):
        ckpt.load(str(tmp_path), 0, 1, JOB)
    _save(tmp_path, 3)
    ckpt.prune(str(tmp_path), 0, {3, 2})
    assert ckpt.generations(str(tmp_path), 0) == [3, 2]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# ---------------------------------------------------------------- whole jobs
@pytest.fixture(scope="module")
def faults():
    return job(3, 1, "faults").stdout


def test_mismatched_declarations_fail_init_params_on_every_worker(faults):
    for worker in (0, 1):
        assert (f"worker {worker}: mismatch: pycoll.ps.init_params: workers declare key 'w' "
                "differently: worker 0 declares float32 [2000], worker 1 float64 [1000]") \
            in faults, faults


def test_duplicate_keys_in_one_call_are_a_value_error(faults):
    for worker in (0, 1):
        assert f"worker {worker}: duplicates: pycoll.ps: key(s) ['w'] appear more than once" \
            in faults, faults


def test_wrong_size_push_fails_with_the_servers_message_and_stays_in_step(faults):
    assert ("worker 1: wrong size: pycoll.ps server 0: worker 1's push says key 'w' is "
            "float32 [0:999] of 999; this server holds float32 [0:1000] of 1000") in faults, faults
    assert faults.count("in step after the refused push") == 2, faults


def test_malformed_requests_are_answered_and_the_server_serves_on(faults):
    expected = {"garbage": "not a pycoll.ps request", "version": "protocol version 99",
                "truncated": "declares 1 keys but carries 0 bytes for them (truncated)",
                "op": "unknown op 99", "payload": "came in messages of [8] bytes where its "
                "keys take [4000]", "dtype": "key 'w' is float64 [0:1000] of 1000; this server "
                "holds float32", "key": "key 'nope', which this server does not hold",
                "order": "out of order"}
    for what, text in expected.items():
        assert re.search(f"malformed {what}: pycoll.ps server 0: .*{re.escape(text)}", faults), \
            (what, faults)
    assert faults.count("served after the malformed requests") == 2, faults


def test_a_failed_communication_thread_fails_pending_work_and_the_next_call(faults):
    assert "worker 1: pending work failed: RuntimeError('injected fault')" in faults, faults
    assert "worker 1: next call: pycoll.ps: this worker's communication thread failed: " \
           "RuntimeError('injected fault')" in faults, faults


def test_bsp_takes_the_mean_over_the_workers_still_active(faults):
    # 3 after two rounds of both; then +2 twice from worker 0 alone (not +1: 2 / 2 workers)
    assert "worker 0: after worker 1 left: 7" in faults, faults


def test_a_payload_that_never_comes_is_given_up_at_the_timeout():
    out = job(3, 1, "silent_payload", timeout_s=2).stdout
    assert re.search(r"worker 0: pycoll.ps server 0: worker 0 \(world rank 0\) sent 0 of the 1 "
                     r"payload messages of its push request \d+ within 2 s; it may have died",
                     out), out
    assert out.count("served on") == 2, out


def test_tags_wrap_around_a_small_tag_space():
    tag_ub = wire.TAG_BASE + 3 * wire.TAGS_PER_SLOT - 1          # 3 requests in flight
    out = job(3, 1, "tag_wrap", str(tag_ub)).stdout
    found = re.findall(r"(\d+) requests through 3 slots, max tag (\d+) <= (\d+); values right", out)
    assert len(found) == 2, out
    for requests, max_tag, limit in found:
        assert int(requests) > 100 * 3 and int(max_tag) <= int(limit) == tag_ub


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job that saved generations 1 (clock 3) and 2 (clock 5)."""
    path = tmp_path_factory.mktemp("ps-checkpoint")
    out = job(3, 1, "checkpoint", str(path), "first").stdout
    assert out.count("saved at clock 5") == 2, out
    return path


def test_checkpoint_resumes(saved, tmp_path):
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    assert sorted(p.name for p in tmp_path.glob("server-0.*")) == [   # the last two, as data
        "server-0.g00000001.bin", "server-0.g00000001.json",
        "server-0.g00000002.bin", "server-0.g00000002.json"]
    out = job(3, 1, "checkpoint", str(tmp_path), "second").stdout
    assert out.count("resumed at clock 5") == 2, out


def test_corrupt_checkpoint_falls_back_to_the_previous_generation_or_is_refused(saved, tmp_path):
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "server-0.g00000002.bin"
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 0x01
    newest.write_bytes(raw)
    out = job(3, 1, "checkpoint", str(tmp_path), "fallback")
    assert out.stdout.count("resumed at clock 3") == 2, out.stdout + out.stderr
    assert f"resuming from generation 1, not 2: {newest}'s SHA-256 differs" in out.stderr, \
        out.stderr
    (tmp_path / "server-0.g00000001.json").write_text("{")       # none intact: refused
    out = job(3, 1, "checkpoint", str(tmp_path), "refused").stdout
    for worker in (0, 1):
        assert re.search(f"worker {worker}: refused: .*no checkpoint generation in {tmp_path} is "
                         f"complete and intact on every server: .*server-0.g00000001.json is not "
                         "valid JSON", out), out


def test_killed_server_resumes_from_its_checkpoint_as_if_never_killed(tmp_path):
    """BSP, 2 servers: a run whose first server is killed after step 6, and whose second
    was cut short writing its newest generation (its manifest is gone), resumes from the
    newest generation complete on both and ends with the parameters of a run never
    interrupted, bit for bit."""
    job(4, 2, "resume", str(tmp_path), "whole")
    killed = job(4, 2, "resume", str(tmp_path), "killed", expect_ok=False)
    assert killed.returncode != 0 and "killed done" not in killed.stdout
    newest = sorted((tmp_path / "ckpt").glob("server-1.g*.json"))[-1]
    newest.unlink()
    out = job(4, 2, "resume", str(tmp_path), "resumed")
    start = [int(c) for c in re.findall(r"resumed from clock (\d+)", out.stdout)]
    assert len(start) == 2 and start[0] == start[1] and 0 < start[0] <= 6, out.stdout
    assert out.stdout.count("resumed done at clock 8") == 2, out.stdout
    assert f"{newest} is missing (the write did not finish)" in out.stderr, out.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "resumed.npy"),
                                  np.load(tmp_path / "whole.npy"))
