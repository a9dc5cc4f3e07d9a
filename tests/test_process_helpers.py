"""The process layer the engine-core client and the multiprocess executor share
(``minivllm.utils``): sockets that queue without a limit, a receive that notices a dead child,
and resources released once, whatever the child did."""

import os
import signal
import time

import pytest

zmq = pytest.importorskip("zmq")

from minivllm.utils import (ProcessResources, child_process_setup, make_socket,  # noqa: E402
                            recv_while_alive)


def test_a_message_arrives_and_a_dead_child_is_noticed():
    resources = ProcessResources()
    try:
        pull = resources.bind(zmq.PULL, "out")
        push = make_socket(resources.ctx, zmq.PUSH, resources.address("out"), bind=False)
        resources.sockets.append(push)
        assert pull.getsockopt(zmq.RCVHWM) == 0 and push.getsockopt(zmq.SNDHWM) == 0
        for i in range(3):  # queued, not dropped
            push.send(b"m%d" % i)
        assert [recv_while_alive(pull, [], RuntimeError) for _ in range(3)] == [b"m0", b"m1",
                                                                                b"m2"]
        child = resources.spawn(time.sleep, (0,), "Sleeper")  # exits at once, sends nothing
        start = time.monotonic()
        with pytest.raises(ChildProcessError, match="Sleeper"):
            recv_while_alive(pull, [child], lambda p: ChildProcessError(p.name))
        assert time.monotonic() - start < 30 and not child.is_alive()
    finally:
        resources()
    assert resources.shutting_down and not os.path.exists(resources.tmpdir)
    assert all(s.closed for s in resources.sockets)


def test_of_two_dead_children_the_one_killed_by_a_signal_is_named():
    """A tensor-parallel worker killed by a signal makes its peer exit (code 1) from the
    collective they shared; whichever is found first, the killed one is the cause named."""
    resources = ProcessResources()
    try:
        pull = resources.bind(zmq.PULL, "out")
        exits = resources.spawn(os._exit, (1,), "Exits")  # listed first, as rank 0 is
        killed = resources.spawn(time.sleep, (60,), "Killed")
        os.kill(killed.pid, signal.SIGKILL)
        for child in (exits, killed):
            child.join(30)
        with pytest.raises(ChildProcessError, match="Killed"):
            recv_while_alive(pull, [exits, killed], lambda p: ChildProcessError(p.name))
        with pytest.raises(ChildProcessError, match="Exits"):  # none killed: the first dead
            recv_while_alive(pull, [exits], lambda p: ChildProcessError(p.name))
    finally:
        resources()


def test_release_stops_a_child_that_is_still_running():
    resources = ProcessResources()
    child = resources.spawn(time.sleep, (60,), "LongSleeper")
    assert child.is_alive() and child.daemon
    resources()
    assert not child.is_alive() and child.exitcode is not None


def _report_setup(address: str) -> None:
    """A spawned child: set itself up, then say whether Ctrl-C is ignored and whether a thread
    watches its parent, and stay until stopped."""
    import threading

    child_process_setup("ParentWatchUnderTest")
    ctx = zmq.Context()
    out = make_socket(ctx, zmq.PUSH, address, bind=False)
    watching = any(t.name == "ParentWatchUnderTest" for t in threading.enumerate())
    out.send(b"%d %d" % (signal.getsignal(signal.SIGINT) is signal.SIG_IGN, watching))
    time.sleep(60)


def test_a_spawned_child_ignores_ctrl_c_and_watches_its_parent():
    resources = ProcessResources()
    try:
        pull = resources.bind(zmq.PULL, "setup")
        child = resources.spawn(_report_setup, (resources.address("setup"),), "SetupChild")
        assert recv_while_alive(pull, [child], lambda p: ChildProcessError(p.exitcode)) == b"1 1"
        os.kill(child.pid, signal.SIGINT)  # what Ctrl-C sends the whole process group
        time.sleep(0.5)
        assert child.is_alive()
    finally:
        resources()
    assert not child.is_alive()
