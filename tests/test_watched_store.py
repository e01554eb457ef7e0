"""The store a live generation's group is built on gives up its waits once a member is reported lost
(adaptive.runtime.watched_store): real TCPStores on 127.0.0.1 and, for the group, real gloo processes."""

from __future__ import annotations

import datetime
import multiprocessing
import threading
import time

import portpicker
import pytest
import torch.distributed as dist

from adaptive.runtime.watched_store import LossWatchedStore


@pytest.fixture
def tcp_store():
    port = portpicker.pick_unused_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=20))
    yield store


def test_a_wait_ends_with_the_key_and_gives_up_once_a_loss_is_reported(tcp_store):
    lost = threading.Event()
    store = LossWatchedStore(dist.PrefixStore("g", tcp_store), lost.is_set, "generation 7 lost a member")
    threading.Timer(0.2, lambda: store.set("a", b"1")).start()
    store.wait(["a"])
    assert store.get("a") == b"1"
    threading.Timer(0.3, lost.set).start()
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="generation 7 lost a member"):
        store.get("never")
    assert time.monotonic() - started < 5, "the wait went on after the loss was reported"


def test_a_wait_with_no_loss_ends_at_its_timeout(tcp_store):
    store = LossWatchedStore(tcp_store, lambda: False, "unused")
    with pytest.raises(dist.DistStoreError, match="not set within"):
        store.wait(["never"], datetime.timedelta(seconds=0.3))


def test_the_calls_pass_through_to_the_store(tcp_store):
    store = LossWatchedStore(tcp_store, lambda: False, "unused")
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x" and store.compare_set("c", "", "y") == b"x"
    assert store.check(["c"]) and not store.check(["d"])
    assert store.delete_key("c") and not store.check(["c"])
    store.set_timeout(datetime.timedelta(seconds=7))
    assert store.timeout == datetime.timedelta(seconds=7)


def _member(rank: int, port: int, lose: bool, results) -> None:
    import torch

    client = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=20))
    watched = LossWatchedStore(dist.PrefixStore("group", client), lambda: client.check(["lost"]), "lost")
    if lose and rank == 2:
        return  # met the others, then died before the group's rendezvous
    if lose and rank == 0:
        threading.Timer(0.5, lambda: client.set("lost", "1")).start()
    started = time.monotonic()
    try:
        dist.init_process_group("gloo", store=watched, rank=rank, world_size=3,
                                timeout=datetime.timedelta(seconds=120))
        side = dist.new_group(backend="gloo")  # gloo clones the store for the group's connections
        value = torch.ones(1)
        dist.all_reduce(value, group=side)
        results.put((rank, "formed", float(value)))
    except (RuntimeError, dist.DistError) as error:
        results.put((rank, type(error).__name__, time.monotonic() - started))


@pytest.mark.parametrize("lose", [False, True], ids=["all-come", "one-lost"])
def test_a_gloo_group_forms_on_it_and_its_rendezvous_gives_up_on_a_lost_member(lose):
    """Three real processes build a gloo group (and a side group) on the watched store; when one of them
    never comes and a loss is reported, the other two fail within seconds instead of the group's 120 s."""
    port = portpicker.pick_unused_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_member, args=(rank, port, lose, results)) for rank in range(3)]
    for process in processes:
        process.start()
    try:
        expected = 2 if lose else 3
        outcomes = sorted(results.get(timeout=60) for _ in range(expected))
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    del server
    if lose:
        assert [rank for rank, _, _ in outcomes] == [0, 1]
        assert all(kind == "DistStoreError" for _, kind, _ in outcomes), outcomes
        assert all(seconds < 15 for _, _, seconds in outcomes), outcomes
    else:
        assert outcomes == [(0, "formed", 3.0), (1, "formed", 3.0), (2, "formed", 3.0)]
