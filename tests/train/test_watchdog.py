"""run.hang_timeout: the watchdog, in-process with a fake clock and fake peers (the two-process
cases, a real stall and a real wedge, are in tests/train/test_multiprocess.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest

from runner.errors import ConfigError
from runner.spec import ExecutionSpec, RunSpec, duration_seconds, validate
from runner.train.watchdog import AUTO_FLOOR_S, Peers, Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakePeers(Peers):
    """The coordination service's key-value store as a dict shared by the 'processes'."""

    def __init__(self, index: int, count: int, store: dict[str, str]) -> None:
        super().__init__(index, count)
        self.store = store

    def hang_reported(self) -> Optional[str]:
        return self.store.get("hang")

    def report_hang(self, text: str) -> None:
        self.store.setdefault("hang", text)

    def acknowledge(self) -> None:
        self.store[f"ack/{self.index}"] = "1"

    def wait_for_all(self, timeout_s: float, clock: Any = None) -> None:
        self.store["waited"] = str(timeout_s)


class FakeLoop:
    def __init__(self) -> None:
        self.step_seconds = 0.0
        self.holder = type("H", (), {"step": 0})()


def make(tmp_path: Path, setting: str, index: int = 0, count: int = 1, store: Optional[dict] = None,
         compile_s: float = 0.0) -> tuple[Watchdog, Clock, list[int], list[str]]:
    clock, left, said = Clock(), [], []
    dog = Watchdog(setting, tmp_path, FakePeers(index, count, {} if store is None else store), lambda: compile_s,
                   storage_bound_s=600.0, clock=clock, leave=left.append, poll_s=0.01, say=said.append,
                   use_faulthandler=False)
    return dog, clock, left, said


def steps(dog: Watchdog, clock: Clock, n: int, seconds: float, first: int = 1) -> None:
    loop = FakeLoop()
    for step in range(first, first + n):
        dog.before_step(loop, step)  # type: ignore[arg-type]
        clock.now += seconds
        loop.step_seconds = seconds
        dog.on_metrics(loop, step, {})  # type: ignore[arg-type]


@pytest.mark.parametrize("text, seconds", [("600", 600), ("90s", 90), ("10m", 600), ("1.5h", 5400), ("0", 0),
                                           (" 20 min", 1200), ("auto", None), ("ten", None), ("-5", None),
                                           ("5d", None), ("", None)])
def test_durations(text: str, seconds: Optional[float]) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("bad", ["ten minutes", "-1", "5d", "", "off"])
def test_a_hang_timeout_that_is_no_duration_is_refused_with_the_fix(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(ExecutionSpec(run=RunSpec(hang_timeout=bad)))
    assert f"run.hang_timeout={bad!r}" in str(err.value) and "10m" in str(err.value) and "0 to turn" in str(err.value)


def test_no_progress_for_the_timeout_writes_the_stacks_and_exits_75(tmp_path) -> None:
    dog, clock, left, said = make(tmp_path, "30s")
    dog.start(FakeLoop())  # type: ignore[arg-type]
    dog.stop()  # the thread is not needed: the test calls check() with its own clock
    steps(dog, clock, 3, 1.0)
    clock.now += 29.5
    assert not dog.check() and left == []  # 29.5 s idle: still within the limit
    steps(dog, clock, 1, 1.0, first=4)  # progress resets it
    clock.now += 29.5
    assert not dog.check()
    clock.now += 1.0
    assert dog.check() and left == [75]
    assert "no progress for 30 s on process 0 (run.hang_timeout=30s: 30 s); the last it saw: step 4 done" in said[0]
    stacks = (tmp_path / "hangs" / "process-0.txt").read_text()
    assert "last step done on this process: 4" in stacks
    assert "test_no_progress_for_the_timeout_writes_the_stacks_and_exits_75" in stacks  # this thread's frame
    assert str(tmp_path / "hangs" / "process-0.txt") in said[0]


def test_the_first_process_to_notice_tells_the_others_which_stop_at_once(tmp_path) -> None:
    store: dict[str, str] = {}
    noticer, c0, left0, said0 = make(tmp_path, "30s", index=1, count=2, store=store)
    other, c1, left1, said1 = make(tmp_path, "30s", index=0, count=2, store=store)
    for dog in (noticer, other):
        dog.armed = True
    steps(noticer, c0, 5, 1.0)
    steps(other, c1, 5, 1.0)
    c1.now += 5  # process 0 saw progress 5 s ago only: its own timer is far from firing
    assert not other.check()
    c0.now += 31
    assert noticer.check() and left0 == [75]
    assert other.check() and left1 == [75]
    assert "process 1 found no progress for 31 s after step 5 done; process 0 stops too" in said1[0]
    assert store["ack/0"] == store["ack/1"] == "1"  # each told the others it heard, and waited for them
    assert (tmp_path / "hangs" / "process-0.txt").exists() and (tmp_path / "hangs" / "process-1.txt").exists()


def test_auto_arms_after_the_first_step_at_the_largest_of_its_floors(tmp_path) -> None:
    dog, clock, left, _ = make(tmp_path, "auto", compile_s=100.0)
    dog.start(FakeLoop())  # type: ignore[arg-type]
    dog.stop()
    assert dog.limit() is None
    clock.now += 10 * AUTO_FLOOR_S  # the first step (compiling, a baseline evaluation) is not judged
    assert not dog.check()
    steps(dog, clock, 1, 1.0)  # one step read: no step time yet (the first is not a step's time)
    assert dog.limit() is None
    steps(dog, clock, 10, 2.0, first=2)
    assert dog.limit() == AUTO_FLOOR_S  # max(600, 3 x 100 s compile, 20 x 2 s)
    steps(dog, clock, 50, 40.0, first=12)
    assert dog.limit() == 20 * 40.0  # slow steps: twenty of them
    with dog.busy("save", 61):
        assert dog.limit() == 800 + 600  # a save may also take the storage bound
    with dog.busy("eval", 61):
        clock.now += 2000  # a long evaluation
    with dog.busy("eval", 62):
        assert dog.limit() == 3 * 2000
    assert left == []


def test_auto_with_a_long_compile(tmp_path) -> None:
    dog, clock, _, _ = make(tmp_path, "auto", compile_s=1000.0)
    steps(dog, clock, 3, 1.0)
    assert dog.limit() == 3000.0


def test_an_explicit_timeout_arms_at_the_first_step_not_during_the_evaluation_before_it(tmp_path) -> None:
    """The evaluation at the loop's start compiles its program, which may take longer than a
    timeout sized for steps (8 s took that on a busy 2-core machine): the duration applies from
    the first step, as documented."""
    dog, clock, left, said = make(tmp_path, "8s")
    dog.start(FakeLoop())  # type: ignore[arg-type]
    dog.stop()
    with dog.busy("eval", 0):
        clock.now += 60  # compiling the evaluation
        assert dog.limit() is None and not dog.check()
    steps(dog, clock, 1, 1.0)
    assert dog.limit() == 8.0
    clock.now += 8.5
    assert dog.check() and left == [75] and "the last it saw: step 1 done" in said[0]


def test_an_explicit_timeout_judges_saves_and_evaluations_too(tmp_path) -> None:
    dog, clock, left, said = make(tmp_path, "60")
    dog.armed = True
    steps(dog, clock, 2, 1.0)
    with dog.busy("save", 2):
        clock.now += 61
        assert dog.check()
    assert left == [75] and "the last it saw: the save at step 2 started" in said[0]


def test_off_builds_no_watchdog() -> None:
    spec = ExecutionSpec(run=RunSpec(hang_timeout="0"))
    assert Watchdog.for_run(spec, Path("."), lambda: 0.0) is None


class FakeClient:
    """jax.distributed's key-value store, the two calls the leaving order uses, safe across threads
    as the real one is (one thread reads while another writes); it counts the reads, so a test can
    wait for the reader to have looked."""

    def __init__(self) -> None:
        import threading

        self.store: dict[str, str] = {}
        self.events: list[str] = []
        self.looks = 0
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            self.store[key] = value
            self.events.append(f"set {key}")

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.changed:
            self.looks += 1
            self.changed.notify_all()
            return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

    def wait_for_looks(self, looks: int, timeout: float = 30.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.looks >= looks, timeout), (self.looks, looks)


def test_process_0_hosting_the_service_leaves_only_after_every_peer_said_it_leaves(monkeypatch) -> None:
    import threading

    from runner.train import watchdog

    monkeypatch.setattr(watchdog, "GONE_GRACE_S", 0.0)
    client, left = FakeClient(), []
    host = Peers(0, 3, client)
    leaving = threading.Thread(target=host.leave_in_order, args=(lambda code: left.append((0, code)), 75, 60.0))
    leaving.start()
    for index in (1, 2):
        # two reads since the last peer left: the first saw a peer still to go, and process 0 read
        # again instead of leaving (the service stays)
        client.wait_for_looks(client.looks + 2)
        assert leaving.is_alive() and (0, 75) not in left
        Peers(index, 3, client).leave_in_order(lambda code, i=index: left.append((i, code)), 75, 10.0)
    leaving.join(5)
    assert left == [(1, 75), (2, 75), (0, 75)]
    assert client.events == ["set runner/watchdog/gone/1", "set runner/watchdog/gone/2"]


def test_process_0_leaves_after_the_timeout_when_a_peer_never_says_so(monkeypatch) -> None:
    client, left = FakeClient(), []
    Peers(0, 2, client).leave_in_order(left.append, 75, 0.3)
    assert left == [75]


def test_process_0_leaves_with_its_code_whatever_its_wait_meets_and_only_the_client_s_error_is_quiet() -> None:
    """The service failing (the client's JaxRuntimeError) ends the wait; any other error (a fault of
    the wait itself) still leaves with the code, and surfaces where `leave` returns (a test's)."""
    from jax.errors import JaxRuntimeError

    class Failing(FakeClient):
        def __init__(self, error: Exception) -> None:
            super().__init__()
            self.error = error

        def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
            raise self.error

    left: list[int] = []
    Peers(0, 2, Failing(JaxRuntimeError("UNAVAILABLE: the service is gone"))).leave_in_order(left.append, 75, 60.0)
    assert left == [75]
    with pytest.raises(RuntimeError, match="changed size"):
        Peers(0, 2, Failing(RuntimeError("dictionary changed size during iteration"))).leave_in_order(
            left.append, 75, 60.0)
    assert left == [75, 75]
